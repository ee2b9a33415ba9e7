"""Tool calling at the OpenAI door: the request's tools checked (with vLLM's messages), and, for
backends that do not take tools themselves, the gateway's own tool calling: tools and past calls
rendered into the prompt, `required` and named calls forced by a JSON-schema constraint, and calls
parsed out of the generated text (streaming too)."""
