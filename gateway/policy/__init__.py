"""Who may call and how much: API keys, client limits, the ASGI guards that apply them."""
