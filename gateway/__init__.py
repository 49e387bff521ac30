"""kvgate's gateway: what sits in front of the pools, not inside one.

``envoy_config`` builds every Envoy bootstrap kvgate runs (the local stack's, the tests', the
chart's via ``scripts/gen_envoy_config.py``) from one ``GatewaySpec``: one pool, or several
behind the model router. ``model_router`` + ``router_cli`` (``kvgate router serve``) are the model
router, an ext_proc stage ahead of each pool's EPP that names the pool from the body's model
(GIE's body-based routing). The model router reuses the EPP's ext_proc plumbing, so it ships in
the EPP image (docker/epp.Dockerfile).
"""
