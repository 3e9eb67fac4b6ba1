"""The aiohttp gateway in front of one or more Triton servers: HTTP, WebSocket and OpenAI-style speech
APIs, the voice API, routing by outstanding cost, health, limits and metrics. See `app.py`."""
