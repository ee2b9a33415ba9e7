"""Token ids to text as a stream: incremental detokenizing and stop strings held back until they resolve."""
