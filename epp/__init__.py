"""kvgate's endpoint picker: an Envoy ext_proc server speaking the GIE protocol.

Layout: ``extproc`` (Envoy messages ↔ one ``Director.pick`` call), ``director`` (the routing
decision), ``scheduling/`` (filters, scorers, pickers, GIE ``EndpointPickerConfig``), ``datastore``
(what signal collectors learn: ``scraper``, ``kv_subscriber`` → ``prefix_index``; endpoints from
``discovery`` / ``k8s``), ``server`` + ``cli`` (wiring). The Envoy bootstrap and the model
router in front of the pools are ``kvgate.gateway``'s.
"""
