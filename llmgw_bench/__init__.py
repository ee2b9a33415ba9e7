"""`llmgw bench`: TTFT and tokens/s of any TGI or OpenAI-compatible endpoint, by `vllm bench serve`'s definitions.

A client tool: it talks HTTP to the server under test; of this project it uses only the SSE reader.
"""
