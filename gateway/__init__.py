"""llm-gateway's HTTP front door: TGI and OpenAI protocols over pluggable backends."""

__version__ = "0.1.0"
