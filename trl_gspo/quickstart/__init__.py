"""The built-in tiny defaults, offline: a tiny Qwen3-MoE model built from a config, a tokenizer built locally, the
addition and calculator-tool tasks, the cold start that teaches the tool format, and reuse of a cold-started model."""
