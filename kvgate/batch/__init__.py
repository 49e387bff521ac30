"""The OpenAI Batch API (`kvgate batch serve`): Files and Batches endpoints, their state in a
SQL database, and a worker that sends each line through the gateway as sheddable work."""
