"""The engine: scheduler, model runner, sampler and the step loop that joins them."""
