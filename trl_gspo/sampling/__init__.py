"""The sampler side of RL: how far the sampler (HF generate, vLLM) and the trainer disagree on the same tokens
(`metrics`), and the vLLM route capture for rollout routing replay (`vllm`). See docs/sampling.md."""
