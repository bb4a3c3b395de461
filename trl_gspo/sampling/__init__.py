"""The sampler side of RL: how far the sampler (HF generate, vLLM) and the trainer disagree on the same tokens
(`mismatch`), and vLLM for rollout routing replay: the engine's options and start checks (`engine`), the route capture
(`routes`) and server mode (`server`). See docs/sampling.md."""
