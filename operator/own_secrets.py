"""Secrets the operator fills with a random value once and never rewrites: engines read them at
start, so a new value would split a pool until every pod restarted (the KV-transfer secret of a
disaggregated pool, the engines' key of a pool with tenants)."""

from __future__ import annotations

import base64
import secrets

from kvgate.operator import children as ch
from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import ApiError, KubeClient
from kvgate.operator.resources import SECRETS


def new_secret_value() -> str:
    # Printable (it becomes an environment variable), 256 bits; base64 for the Secret's data.
    return base64.b64encode(secrets.token_urlsafe(32).encode()).decode()


async def ensure_random_secret(
    client: KubeClient, owner: ch.Owner, config: OperatorConfig, name: str, key: str, component: str
) -> str:
    """Creates Secret `name` with a random `key` if it is missing; one we made keeps its value
    on every later pass. Returns what was done: created, refilled or unchanged."""
    live = await client.get(SECRETS, owner.namespace, name)
    if live is None:
        labels = ch.standard_labels(owner.name, component, {ch.LABEL_MD: owner.name, **config.extra_labels})
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": ch.object_meta(name, owner, labels),
            "type": "Opaque",
            "data": {key: new_secret_value()},
        }
        await client.create(SECRETS, owner.namespace, body)
        return "created"
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    if not any(r.get("uid") == owner.uid and r.get("controller") for r in refs):
        raise ApiError(
            409, "Conflict", f"Secret {owner.namespace}/{name} exists and is not managed by kvgate"
        )
    if not (live.get("data") or {}).get(key):
        # Someone emptied it: pods started from now on need a value; ones running keep theirs.
        await client.patch(SECRETS, owner.namespace, name, {"data": {key: new_secret_value()}})
        return "refilled"
    return "unchanged"
