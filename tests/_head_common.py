"""Shared by the FSDP2 head worker and its test: a tiny Llama whose vocabulary dominates its
memory, per-rank lengths (rank 0 short, rank 1 long), the batches."""

import torch

HEAD_VOCAB = 8000
HEAD_LENGTHS = {0: [8, 12, 8, 16, 8, 12], 1: [64, 16, 64, 48, 64, 64]}


def head_model():
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=37, vocab_size=HEAD_VOCAB, use_cache=False)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).train()


def head_batch(step: int, rank: int, length: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, HEAD_VOCAB, (4, length), generator=g)
    return {"input_ids": ids, "labels": ids}


def plan_with_head(options, head_options, need_bytes, resolution=1024, order=None):
    """The planner's plan with the LM head the one part beside the blocks (NOTE [The head in the plan])."""
    from memfit.engine.plan.planner import plan_with_parts

    return plan_with_parts(options, [("head", head_options)] if head_options else [], need_bytes, resolution, order)
