"""Tool calling for chat completions (vLLM's `tools` / `tool_choice` surface).

`request` turns a request's tools and tool_choice into a `ToolPlan` (what to render, what to
constrain, how to read the output); `parsers` reads tool calls out of generated text (the
`--tool-call-parser` registry); `stream` turns a growing text into OpenAI tool-call deltas.
"""
