"""The recipe tokenizer gateway: HTTP APIs (OpenAI Chat/Responses, Anthropic Messages) over the stack."""
