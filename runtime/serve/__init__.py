"""The serving core: engine client, scheduler, model runner, speculation, sampling, grammar, tokenizer."""
