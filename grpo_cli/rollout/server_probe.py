"""What the server sampler checks a vLLM server against (grpo_cli/rollout/vllm_server.py): the probe prompt's
log-probs from the policy and from the server, how far apart they may be (at start: the same base model; after a full
push: the weights it was sent), and which weight a full push writes twice (a tied LM head, for vLLM's CPU build)."""

from __future__ import annotations

import torch

from grpo_cli.rollout.vllm_engine import base_model

# the probe's tolerance: mean |log-prob difference| per token between the server's base model and the policy's base,
# in nats; the same weights in fp32 differ by ~1e-4, bf16 by ~1e-2, another model by whole nats
PROBE_TOLERANCE = 0.25
# after a full push the server must answer the probe as the weights it was sent do: a mean gap of at most PUSH_FACTOR
# times the start's (what the two sides' precisions cost on this model), and never less than PUSH_FLOOR nats.
# SmolLM2, measured: vLLM and HF in fp32 ~1e-5; HF's bf16 forward against its fp32 one 0.10 at the start, 0.08-0.30
# after random 2% moves of every weight; vLLM in fp32 with the LM head left as it started, after such a move, 0.21
PUSH_FACTOR = 4
PUSH_FLOOR = 0.01
# vLLM 0.32's models that compute a tied model's logits with the embedding layer itself (no LM head of their own):
# their loader refuses a weight named for a head, and the embeddings' reload refreshes what computes the logits
NO_HEAD = frozenset({"CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "Gemma2ForCausalLM",
                     "Gemma3nForCausalLM"})


def tied_head(model) -> tuple[str, str] | None:
    """(the embeddings' weight name, the LM head's) of a causal LM whose head is its embeddings' Parameter
    (tie_word_embeddings: the weight is written once, under the embeddings' name); None when the head is its own,
    and for the models vLLM computes the logits of with the embedding layer itself (NO_HEAD)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or type(model).__name__ in NO_HEAD:
        return None
    first = {id(p): name for name, p in model.named_parameters()}  # a tied Parameter under the first name it has
    head_name = next(name for name, m in model.named_modules() if m is head) + ".weight"
    name = first.get(id(head.weight))
    return (name, head_name) if name is not None and name != head_name else None


@torch.no_grad()
def probe_logprobs(policy) -> tuple[list[int], torch.Tensor]:
    """The probe prompt (token ids spread over the vocabulary) and the policy's log-prob of each token after the
    first, [P - 1] on the host: the policy's forward as it is now (the caller turns adapters off for the base)."""
    vocab = base_model(policy).config.vocab_size
    probe = [i % vocab for i in (1, 3, 7, 15, 31, 63, 127, 255, 511, 1023, 2047, 4095, 8191, 16383)]
    ids = torch.tensor([probe], device=next(policy.parameters()).device)
    logits = policy(input_ids=ids).logits.float()  # [1, P, V]
    return probe, torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


def prompt_logprob(entry: dict, token: int) -> float:
    """The log-prob of `token` in one position of vLLM's `prompt_logprobs` ({token id: {logprob, ...}})."""
    value = entry.get(str(token), entry.get(token))
    return float(value["logprob"] if isinstance(value, dict) else value)
