"""revolta's OpenAI- and Anthropic-compatible reference server."""
