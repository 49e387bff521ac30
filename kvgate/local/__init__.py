"""`kvgate up`: engines, the EPP and Envoy as supervised processes on loopback."""
