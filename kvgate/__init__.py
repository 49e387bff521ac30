"""kvgate: Kubernetes-native LLM serving."""
