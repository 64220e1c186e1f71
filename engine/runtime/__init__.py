"""What runs the model: engine, scheduler, model runner, sampling, stopping, logprobs, tokenizer."""
