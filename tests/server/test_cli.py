"""The `pagedserve` console script, run as a user runs it (a subprocess)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pagedserve.engine.engine_config import EngineConfig, ModelOptions, SpeculativeOptions
from pagedserve.engine.options import GROUPS, option
from pagedserve.kernels import triton_attention
from pagedserve.server.cli import build_parser, main
from pagedserve.server.server_config import ServerConfig
from tests.server.util import PAGEDSERVE


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PAGEDSERVE, *args], capture_output=True, text=True, timeout=timeout)


def test_kv_plan_prints_the_formula_and_exact_numbers():
    res = _run(
        "kv-plan", "--model", "smollm2-135m-instruct", "--max-model-len", "8192",
        "--num-seqs", "64", "--dtype", "bfloat16",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # 2 x 3 KV heads x 64 x 2 bytes per layer; x 30 layers; x 64 sequences x 8192 tokens.
    assert "per layer per token: 2 x 3 x 64 x 2 = 768 bytes" in res.stdout
    assert "per token: 30 layers x 768 = 23040 bytes" in res.stdout
    assert "= 2*64*30*8192*3*64*2 = 12079595520 bytes" in res.stdout
    assert "blocks: 512 per sequence of block_size 16, 32768 in all" in res.stdout


def test_kv_plan_with_an_fp8_cache_halves_bf16s_bytes(capsys):
    args = ["kv-plan", "--model", "smollm2-135m-instruct", "--max-model-len", "8192",
            "--num-seqs", "64", "--dtype", "bfloat16"]  # fmt: skip
    assert main([*args, "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    # One byte per value: half of test_kv_plan_prints_the_formula_and_exact_numbers' bf16 plan.
    assert "dtype float8_e4m3fn (1 bytes)" in out
    assert "per layer per token: 2 x 3 x 64 x 1 = 384 bytes" in out
    assert "per token: 30 layers x 384 = 11520 bytes" in out
    assert "= 2*64*30*8192*3*64*1 = 6039797760 bytes" in out
    assert main([*args, "--kv-cache-dtype", "fp8_e5m2"]) == 0
    assert "dtype float8_e5m2 (1 bytes)" in capsys.readouterr().out


def test_kv_plan_counts_the_lora_slots(capsys):
    args = ["kv-plan", "--model", "smollm2-135m-instruct", "--num-seqs", "4", "--enable-lora"]
    assert main(args) == 0
    # Per layer at rank 64, A (parts x in) and B (out) rows: qkv (3 x 576 + 960), o (576 + 576),
    # gate_up (2 x 576 + 3072), down (1536 + 576); 30 layers, 4 slots, 2 bytes.
    per_layer = ((3 * 576 + 960) + (576 + 576) + (2 * 576 + 3072) + (1536 + 576)) * 64
    expected = per_layer * 30 * 4 * 2
    assert expected == 156303360
    assert (
        f"LoRA slots: 4 adapters up to rank 64, {expected} bytes (149.1 MiB) in bfloat16"
        in capsys.readouterr().out
    )
    # On two ranks, rank 0's slice (6 of 9 query heads, 2 of 3 KV heads, 768 of the 1536 MLP
    # width): qkv's B rows 384 + 2 x 128, o's A columns 384, gate_up's B 2 x 768, down's A 768.
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    per_layer = ((3 * 576 + 640) + (384 + 576) + (2 * 576 + 1536) + (768 + 576)) * 64
    assert per_layer * 30 * 4 * 2 == 113049600
    assert (
        "LoRA slots: 4 adapters up to rank 64, 113049600 bytes (107.8 MiB) per rank in bfloat16"
        in capsys.readouterr().out
    )


def test_kv_plan_splits_the_kv_heads_over_tensor_parallel_ranks(capsys):
    args = ["kv-plan", "--model", "smollm2-135m-instruct", "--max-model-len", "8192",
            "--num-seqs", "64", "--dtype", "bfloat16", "--tensor-parallel-size"]  # fmt: skip
    assert main([*args, "2"]) == 0
    out = capsys.readouterr().out
    # 3 KV heads: 2 + 1; rank 0's share is 2/3 of the 12079595520 bytes of the whole.
    assert "query/KV heads per rank 6/2, 3/1 (3 KV heads do not divide by 2: uneven split)" in out
    assert "rank 0: KV heads 0..1 (2): 15360 bytes per token, 8053063680 bytes (7.500 GiB)" in out
    assert "rank 1: KV heads 2..2 (1): 7680 bytes per token, 4026531840 bytes (3.750 GiB)" in out
    assert main([*args, "4"]) == 0  # fewer KV heads than ranks: one each, replicated
    out = capsys.readouterr().out
    assert "per rank 2/1, 1/1, 3/1, 3/1 (3 KV heads replicated over 4 ranks)" in out
    assert "rank 1: KV heads 0..0 (1): 7680 bytes per token" in out
    assert main([*args, "10"]) == 2
    assert "exceeds the model's 9 attention heads" in capsys.readouterr().err


def test_kv_plan_for_a_builtin_shape(capsys):
    args = ["kv-plan", "--model", "llama-3.1-8b", "--max-model-len", "1024", "--num-seqs", "1",
            "--dtype", "float16"]  # fmt: skip
    assert main(args) == 0
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 bytes x 2 = 131072 bytes per token.
    assert "per token: 32 layers x 4096 = 131072 bytes" in capsys.readouterr().out


def test_kv_plan_prints_what_sliding_windows_save(capsys):
    # In-process (main), as the console script calls it: Gemma 3 27B at 32k, past the window.
    assert main(["kv-plan", "--model", "gemma-3-27b", "--max-model-len", "32768",
                 "--num-seqs", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "= 16642998272 bytes (15.500 GiB)" in out  # every layer full
    # 52 sliding layers hold 1024 / 16 + 1 blocks, the 10 global ones all 2048.
    assert "52 of 62 layers slide over 1024 tokens and hold 65 blocks per sequence" in out
    assert "3127377920 bytes (2.913 GiB, 5.32x less than without)" in out
    assert "7 groups of 10 layers" in out and "2438 blocks per sequence" in out
    assert "3195535360 bytes (2.976 GiB)" in out
    # Past the model's context a plan is still made, with a note.
    assert main(["kv-plan", "--model", "gemma-2-9b", "--max-model-len", "32768",
                 "--num-seqs", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "2 groups of 21 layers" in out and "1.78x less than without" in out
    assert "exceed the model's context length 8192" in out


def test_generate_chat_answers_with_the_real_model():
    res = _run(
        "generate",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
        "--device",
        "cpu",
        # A small cache (this test's process memory) that holds one sequence of the context
        # given at either CPU level: float32 (avx2's default dtype) fits 5,800 tokens in it.
        "--kv-cache-memory",
        "0.25",
        "--max-model-len",
        "2048",
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_bench_throughput_writes_json(tiny_llama_dir, tmp_path, capsys):
    # In-process (main, as the console script calls it; test_attention_backend_option_reaches_
    # the_engine runs `bench throughput` as a subprocess).
    out = tmp_path / "tp.json"
    # A small KV cache: this process keeps what it touched (the CPU default is 4 GiB).
    args = ["bench", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--num-prompts", "5", "--input-len", "12", "--output-len", "7",
            "--kv-cache-memory", "0.05", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    assert "output tokens/s" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 5 and data["num_output_tokens"] == 35
    assert data["output_tokens_per_s"] > 0 and data["requests_per_s"] > 0


def test_bench_throughput_with_dummy_weights(tmp_path):
    out = tmp_path / "dummy.json"
    args = ["bench", "throughput", "--model", "smollm2-135m", "--load-format", "dummy",
            "--device", "cpu", "--max-model-len", "256", "--num-prompts", "2", "--input-len", "8",
            "--output-len", "3", "--kv-cache-memory", "0.05", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    assert json.loads(out.read_text())["num_output_tokens"] == 6


def test_unknown_model_is_a_clear_error():
    res = _run("generate", "--model", "/no/such/model", "--prompt", "hi", "--device", "cpu")
    assert res.returncode == 2
    assert "error: " in res.stderr and "/no/such/model" in res.stderr


SERVE_REFUSALS = [
    (("--max-queue-len", "0"), "--max-queue-len must be >= 1, got 0"),
    (("--request-timeout", "0"), "--request-timeout must be > 0 seconds, got 0.0"),
    (("--max-n", "0"), "--max-n must be >= 1, got 0"),
    (("--max-request-body-bytes", "0"), "--max-request-body-bytes must be >= 1, got 0"),
    (("--port", "70000"), "port must be in [0, 65535], got 70000"),
]


def test_serve_refuses_bad_options_before_loading():
    # The console script once; the other cases call its main() in one fresh interpreter (a
    # process each would repeat the imports, about 5 s apiece here, for the same code path).
    (first, first_message), *rest = SERVE_REFUSALS
    res = _run("serve", *first, timeout=60)
    assert (res.returncode, res.stdout) == (2, "")
    assert f"error: {first_message}" in res.stderr, res.stderr
    script = (
        "import sys\nfrom pagedserve.server.cli import main\n"
        f"for args in {[list(args) for args, _ in rest]!r}:\n"
        "    print(main(['serve', *args]), file=sys.stderr)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    lines = res.stderr.splitlines()
    assert res.returncode == 0 and len(lines) == 2 * len(rest), res.stderr
    for (args, message), error, status in zip(rest, lines[::2], lines[1::2], strict=True):
        assert (error, status) == (f"error: {message}", "2"), args


def test_serve_on_a_busy_port_is_a_clear_error(tiny_llama_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _run(
            "serve",
            "--model",
            str(tiny_llama_dir),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--max-model-len",
            "128",
            timeout=120,
        )
    assert res.returncode == 2
    assert f"error: could not serve on 127.0.0.1:{port}: Address already in use" in res.stderr
    assert "loaded in" not in res.stderr  # refused before the model loads


def _serve_config(*flags: str, config_cls=EngineConfig) -> EngineConfig:
    args = build_parser(config_cls).parse_args(["serve", *flags])
    return args.config_cls.from_cli_args(args)


def _serve_help(capsys, config_cls=EngineConfig) -> str:
    """`pagedserve serve --help`, white space folded."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"], config_cls=config_cls)
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_every_engine_option_is_a_flag_with_the_fields_default(capsys):
    # The flags are generated from EngineConfig: nothing to keep in step by hand.
    assert _serve_config() == EngineConfig()
    help_text = _serve_help(capsys)
    for name in EngineConfig().options():
        assert f"--{name.replace('_', '-')}" in help_text


def test_flags_reach_the_engine_config():
    config = _serve_config(
        "--enforce-eager", "--gpu-memory-utilization", "0.5", "--max-cuda-graph-batch-size", "64",
        "--kv-cache-memory", "0.25", "--no-prefix-caching", "--num-kv-blocks", "100",
        "--dtype", "bf16", "--max-num-batched-tokens", "512",
    )  # fmt: skip
    assert (config.model.enforce_eager, config.cache.gpu_memory_utilization) == (True, 0.5)
    assert config.model.max_cuda_graph_batch_size == 64
    assert config.cache.kv_cache_memory == 1 << 28  # GiB on the command line, bytes in the config
    assert (config.cache.enable_prefix_caching, config.cache.num_kv_blocks) == (False, 100)
    assert (config.model.dtype, config.scheduler.max_num_batched_tokens) == ("bf16", 512)
    assert _serve_config("--enable-prefix-caching").cache.enable_prefix_caching is True
    assert _serve_config("--no-enable-prefix-caching").cache.enable_prefix_caching is False


def test_the_help_states_each_default_once_and_right(capsys):
    help_text = _serve_help(capsys)
    assert "--block-size BLOCK_SIZE tokens per KV-cache block (default: 16)" in help_text
    assert "--max-num-seqs MAX_NUM_SEQS most sequences in one step (default: 256)" in help_text
    # Unset, the step budget is derived, and the help says how (it once claimed 2048).
    assert "in chunks (default: max(2048, max_num_seqs))" in help_text
    assert "(default: no cap: every step may take the whole budget, as vLLM's scheduler does)" in (
        help_text
    )
    assert EngineConfig(max_num_seqs=4096).scheduler.step_token_budget == 4096
    assert EngineConfig().scheduler.step_token_budget == 2048
    assert "one compiled call per step (GGUF weights kept quantized) (default: False)" in help_text


def test_the_server_options_are_flags_in_their_groups(capsys):
    # ServerConfig's fields are `serve`'s flags too, in --help's groups beside the engine's.
    assert ServerConfig.from_cli_args(build_parser().parse_args(["serve"])) == ServerConfig()
    help_text = _serve_help(capsys)
    for f in dataclasses.fields(ServerConfig):
        assert f"--{f.name.replace('_', '-')}" in help_text
    sections = [help_text.index(f"{group} options:") for group in GROUPS]
    assert sections == sorted(sections)
    parallel = help_text[
        sections[GROUPS.index("parallel")] : sections[GROUPS.index("parallel") + 1]
    ]
    assert "--tensor-parallel-size" in parallel and "--data-parallel-size M" in parallel
    args = build_parser().parse_args(
        ["serve", "--served-model-name", "a", "b", "--no-access-log", "--no-core-process"]
    )
    server = ServerConfig.from_cli_args(args)
    assert (server.served_model_name, server.access_log, server.core_process) == (
        ("a", "b"), False, False
    )  # fmt: skip
    with pytest.raises(ValueError, match="drop --no-core-process"):
        ServerConfig(data_parallel_size=2, core_process=False)


@dataclasses.dataclass(frozen=True)
class MoreSpeculative(SpeculativeOptions):
    num_speculative_tokens: int = option(3, "draft tokens proposed per step")


@dataclasses.dataclass(frozen=True)
class OtherModel(ModelOptions):
    quantization: str | None = option(None, "weight quantization", choices=("fp8",))


@dataclasses.dataclass(frozen=True, init=False)
class WithNewOption(EngineConfig):
    # A new option is one field of its group (here a subclass of the group, and of the config).
    model: OtherModel
    speculative: MoreSpeculative


def test_a_new_engine_config_field_appears_in_serve_help(capsys):
    help_text = _serve_help(capsys, WithNewOption)
    assert (
        "--num-speculative-tokens NUM_SPECULATIVE_TOKENS draft tokens proposed per step "
        "(default: 3)" in help_text
    )
    assert "--quantization {fp8} weight quantization" in help_text
    config = _serve_config("--num-speculative-tokens", "5", config_cls=WithNewOption)
    assert isinstance(config, WithNewOption) and config.speculative.num_speculative_tokens == 5
    assert _serve_config(config_cls=WithNewOption).speculative.num_speculative_tokens == 3
    fp8 = _serve_config("--quantization", "fp8", config_cls=WithNewOption)
    assert fp8.model.quantization == "fp8"
    with pytest.raises(ValueError, match=r"quantization must be one of \['fp8'\], got 'int4'"):
        WithNewOption(quantization="int4")


def test_bad_flag_values_are_refused_by_the_config():
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        _serve_config("--block-size", "0")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        _serve_config("--gpu-memory-utilization", "1.5")


def test_attention_backend_option_reaches_the_engine(
    tiny_llama_dir, tmp_path, capsys, monkeypatch, caplog
):
    # In-process, as the console script calls main (test_load.py runs `pagedserve bench serve`
    # as a process); TRITON_INTERPRET=1 (tests/conftest.py) lets the Triton kernels run on CPU.
    with caplog.at_level("INFO", logger="pagedserve"):
        code = main([
            "bench", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--dtype", "float32", "--attention-backend", "triton", "--num-prompts", "2",
            "--input-len", "6", "--output-len", "3", "--json", str(tmp_path / "tp.json"),
            "--kv-cache-memory", "0.05",
        ])  # fmt: skip
    assert code == 0
    assert "float32 on cpu, triton attention" in caplog.text  # the default on CPU is torch
    assert json.loads((tmp_path / "tp.json").read_text())["num_output_tokens"] == 6
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--attention-backend", "flash"])
    assert exit_info.value.code == 2 and "invalid choice: 'flash'" in capsys.readouterr().err
    # Without the interpreter the Triton kernels cannot take CPU tensors: refused before loading.
    # In this process, as a process started without TRITON_INTERPRET has it (the flag is read
    # once, when the kernels' module is imported).
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)
    code = main(["bench", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu",
                 "--attention-backend", "triton"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "error: the Triton attention kernels need CUDA tensors, got tensors on cpu" in err


def test_the_entry_point_tunes_the_allocator(monkeypatch, capsys):
    # A process-wide setting: `pagedserve` makes it, the engine (a library object) never does
    # (tests/test_architecture.py checks that only entry points call it).
    calls = []
    monkeypatch.setattr(
        "pagedserve.server.cli.keep_large_allocations_in_heap", lambda: calls.append(1)
    )
    argv = ["kv-plan", "--model", "smollm2-135m", "--max-model-len", "64", "--num-seqs", "1"]
    assert main(argv) == 0
    assert calls == [1]
    assert "blocks: 4 per sequence of block_size 16, 4 in all" in capsys.readouterr().out


def test_bench_without_its_extra_is_a_clear_error(monkeypatch, capsys):
    # As if `pip install pagedserve` without [bench]: httpx cannot be imported.
    for name in [m for m in sys.modules if m.startswith("pagedserve.bench")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "httpx", None)
    assert main(["bench", "serve", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: import of httpx halted; None in sys.modules: the benchmarks' dependencies come "
        "with pip install 'pagedserve[bench]'\n"
    )
