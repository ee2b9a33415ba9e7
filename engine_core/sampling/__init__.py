"""What a request asks of sampling, and the sampler that does it over a batch of logits."""
