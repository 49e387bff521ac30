"""What more than one component shares, by kind:

- `kvgate.api.contracts`: wire contracts (KV-event wire format, metric names and thresholds);
- `kvgate.api.k8s`: Kubernetes types (the CRD models and their schema generator);
- the modules at this level: shared library code, the one copy both sides run: the tokenizer
  and the prompt path (`tokenizer`, `prompt`, `chat_template`, `template_worker`), Hugging Face
  Hub downloads (`hub`) and the argparse value types every CLI uses (`cli_args`).

None of it imports a component (engine, epp, operator); tests/test_foundation.py checks the
floors.
"""
