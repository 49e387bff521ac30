"""One gateway, several pools: the headers the model router sets and the gateway routes on.

The model router (``kvgate router serve``, GIE's body-based routing) reads each request body's
``model`` and names it in ``X-Gateway-Model-Name`` (GIE's header: an HTTPRoute per pool matches
it, as the operator writes them) and, for kvgate's own gateway, the pool in ``x-kvgate-pool``
(internal-only: a client never chooses its pool).
"""

from __future__ import annotations

MODEL_NAME_HEADER = "X-Gateway-Model-Name"  # HTTP header names are case-insensitive
POOL_HEADER = "x-kvgate-pool"
