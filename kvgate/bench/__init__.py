"""`kvgate bench`: a load generator for OpenAI-compatible endpoints and a routing-strategy comparison."""
