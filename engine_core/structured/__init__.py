"""Constrained decoding: compile a constraint into a grammar (off the step loop, cached by content),
keep one matcher per sequence, and mask each step's logits with its token bitmask before sampling.

Only `params` is imported eagerly: the grammar library (xgrammar) loads on the first constrained
request, so an engine that never sees one never pays for it.
"""

from engine_core.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
