"""The EPP's scheduling plugins, one module each, named after its plugin type
(``queue-scorer`` in ``queue_scorer.py``), its test in tests/epp/plugins/test_<module>.py.

Each module registers its class with ``@register`` (kvgate.epp.scheduling.registry) and declares
what it consumes; ``registry.plugin_types()`` imports every module here whose name does not start
with "_" (those are helpers shared by several plugins).
"""
