"""``megatape generate`` and sampling on the device, on the CPU (the Triton interpreter).

The checkpoint is built once per module, with no download (``tests/tiny_checkpoint.py``): a BPE
tokenizer (byte level) trained with the ``tokenizers`` library on a small corpus with multi-byte
characters, wrapped as a ``PreTrainedTokenizerFast`` with a chat template, and a tiny random
``LlamaForCausalLM`` (2 layers, d 64, its vocabulary the tokenizer's), both saved with
``save_pretrained`` into one directory.

* greedy ``megatape generate`` prints exactly the text of transformers' greedy ``generate`` (fp32 on
  the same bf16 weights, as ``test_hf.py``; the seed and prompt keep the top-2 logit margin >= 0.3);
* seeded sampling repeats with the seed and changes with it; the CLI prints what the library makes;
* SAMPLE's draws at one step follow softmax(logits / T) restricted by transformers' top-k and
  top-p warpers (a chi-square test over 2000 seeds, which rejects a 1.3x temperature); the device
  function (one SAMPLE instruction in the interpreter kernel) draws the same tokens as its
  ``run_torch`` for the first seeds, and ``tl.randint`` is the Philox of ``philox_randint``;
* EOS ids and ``--stop`` end generation; streamed pieces add up to the final text, multi-byte
  characters whole;
* bad input: one line on stderr naming the argument, exit status 2, nothing printed or run.
"""
from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

from conftest import require_interpreter

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from interp.decoder import build_decoder, decode_step, generate  # noqa: E402
from interp.runtime import build_layer, launch, teardown  # noqa: E402
from interp.textgen import Checkpoint, TextStream, generate_text  # noqa: E402
from megatape import cli  # noqa: E402
from opcodes import HEADER, NO_COUNTER, WORDS, Argmax, Sample, SampleMass  # noqa: E402
from opcodes.sample import (cand_path_torch, chunk_cands_torch, chunk_mass_torch, chunk_size, n_cands,  # noqa: E402
                            philox_randint, sample_torch, wants_cands)
from schedule.decoder_program import lower_decoder  # noqa: E402
from schedule.tape import Tape  # noqa: E402
from schedule.vm import VMState  # noqa: E402
from tiny_checkpoint import MAX_POS, MIN_MARGIN, N_NEW, PROMPT, save_tiny_checkpoint  # noqa: E402

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(directory, tokenizer, transformers' fp32 model of the saved bf16 weights)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = save_tiny_checkpoint(path)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, tok, hf


@pytest.fixture(scope="module")
def greedy(ckpt):
    """transformers' greedy generate: (prompt ids, new ids, top-2 margin per step)."""
    _, tok, hf = ckpt
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    margins = [float(v[0] - v[1]) for v in (torch.topk(s[0].float(), 2).values for s in out.scores)]
    return ids, out.sequences[0, len(ids):].tolist(), margins


@pytest.fixture(scope="module")
def sampler(ckpt):
    """(Checkpoint, a sampling decoder of 16 positions: the size megatape generate builds here)."""
    c = Checkpoint.open(ckpt[0])
    h = c.build(16, sampling=True)
    yield c, h
    teardown(h.layer)


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _copy(src, dst, drop=()):
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in drop])
    return dst


# ---- greedy: the text of transformers' greedy generate ------------------------------------------
def test_greedy_cli_prints_transformers_greedy_text(ckpt, greedy, capsys):
    path, tok, _ = ckpt
    ids, new, margins = greedy
    assert min(margins) >= MIN_MARGIN, f"transformers' top-2 margins {margins}: a near-tie"
    want = tok.decode(new, skip_special_tokens=True)
    rc, out, err = run(capsys, "generate", "--model", path, "--prompt", PROMPT, "--max-new-tokens", N_NEW)
    assert rc == 0, err
    assert out == want
    assert f"prompt tokens {len(ids)}, new tokens {N_NEW} (stopped by --max-new-tokens)" in err
    for s in ("time to first token", "tokens/s", "x floor n/a (no GPU)", "greedy"):
        assert s in err, s


def test_greedy_keeps_argmax_and_sampling_swaps_in_sample(sampler):
    c, h = sampler
    g = c.build(16, sampling=False)
    try:
        assert Argmax in g.tape.classes() and Sample not in g.tape.classes()
        assert Sample in h.tape.classes() and Argmax not in h.tape.classes()
        # the same program up to the LM head; then ARGMAX, or a SAMPLE_MASS stage and SAMPLE
        a, s = lower_decoder(g.lay), lower_decoder(g.lay, sample=True)
        n = len(a.instrs) - 1
        assert a.instrs[:n] == s.instrs[:n] and a.waits[:n] == s.waits[:n] and a.signal[:n] == s.signal[:n]
        nparts, ch = a.instrs[-1].nparts, chunk_size(g.lay)
        assert isinstance(a.instrs[-1], Argmax) and s.instrs[-1] == Sample(nparts)
        assert s.instrs[n:-1] == [SampleMass(c0, nparts) for c0 in range(0, g.lay.cfg.vocab, ch)]
        assert {s.waits[i] for i in range(n, len(s.instrs) - 1)} == {a.waits[-1]}      # the LM head's counter
        assert s.waits[-1] == (s.signal[n],) and len({s.signal[i] for i in range(n, len(s.instrs) - 1)}) == 1
    finally:
        teardown(g.layer)


def test_sample_mass_operands_and_vm_errors(sampler):
    """SAMPLE_MASS names a bad operand (a chunk start off the grid or past the vocabulary, the
    partials' count), and its VM semantics ask for the sampling parameters as SAMPLE's do."""
    _, h = sampler
    lay, ch = h.lay, chunk_size(h.lay)
    n = lay.n_lm_tiles
    assert SampleMass(0, n).check_operands(lay) == []
    assert "c0 1 is not a chunk start" in SampleMass(1, n).check_operands(lay)[0]
    assert "not a chunk start" in SampleMass(-(-lay.cfg.vocab // ch) * ch, n).check_operands(lay)[0]
    assert "nparts 3 is not the number of LM head tiles" in SampleMass(0, 3).check_operands(lay)[0]
    with pytest.raises(ValueError, match="sampling parameters"):
        SampleMass(0, n).run_torch(lay, VMState.__new__(VMState))


@pytest.mark.parametrize("how", ["prompt-file", "stdin"])
def test_prompt_from_a_file_or_stdin(ckpt, greedy, capsys, monkeypatch, tmp_path, how):
    path, tok, _ = ckpt
    _, new, _ = greedy
    if how == "stdin":
        monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
        extra = []
    else:
        (tmp_path / "p.txt").write_text(PROMPT, encoding="utf-8")
        extra = ["--prompt-file", tmp_path / "p.txt"]
    rc, out, err = run(capsys, "generate", "--model", path, "--max-new-tokens", 1, *extra)
    assert rc == 0, err
    assert out == tok.decode(new[:1], skip_special_tokens=True)


def test_chat_template(sampler):
    c, _ = sampler
    want = c.tokenizer.apply_chat_template([{"role": "user", "content": "hi é"}], add_generation_prompt=True,
                                           tokenize=False)
    assert want.startswith("<s>user: hi é\n") and want.endswith("assistant:")
    assert c.tokenizer.decode(c.encode("hi é", chat=True)) == want
    assert c.encode("hi é") == c.tokenizer("hi é")["input_ids"]


# ---- sampling: reproducible, EOS, the library and the CLI agree ---------------------------------
SAMPLING = dict(temperature=1.0, top_k=50, top_p=0.95)
N_SAMPLED = 5


def test_seeded_sampling_is_reproducible(sampler, greedy, capsys):
    c, h = sampler
    ids = greedy[0]

    def text(seed):
        g = generate_text(h, c.tokenizer, ids, N_SAMPLED, seed=seed, eos_token_ids=c.eos_token_ids, **SAMPLING)
        pieces = list(g)
        assert "".join(pieces) == g.text                     # the stream is the text
        return g.text, g.tokens

    a, d = text(11), text(12)
    assert len(a[1]) == N_SAMPLED and a[1] != greedy[1][:N_SAMPLED]
    assert a[1] != d[1], "another seed drew the same tokens"
    # the same seed again, through the Python API: the same tokens, up to an EOS id (included)
    k = a[1].index(a[1][2])
    assert generate(h, ids, N_SAMPLED, seed=11, eos_token_ids=a[1][2], **SAMPLING).tolist() == a[1][:k + 1]
    # and through megatape generate, which builds the same decoder: the same text
    rc, out, err = run(capsys, "generate", "--model", c.path, "--prompt", PROMPT, "--max-new-tokens", N_SAMPLED,
                       "--temperature", 1.0, "--top-k", 50, "--top-p", 0.95, "--seed", 11)
    assert rc == 0, err
    assert out == a[0]
    assert "sampled: temperature 1, top-k 50, top-p 0.95, seed 11" in err


def test_eos_ends_generation(ckpt, greedy, capsys, tmp_path):
    """generation_config.json's eos_token_id (a list) names the 3rd greedy token: the text stops before it."""
    path, tok, _ = ckpt
    _, new, _ = greedy
    d = _copy(path, tmp_path / "ck")
    gc = json.loads((d / "generation_config.json").read_text())
    gc["eos_token_id"] = [tok.eos_token_id, new[2]]
    (d / "generation_config.json").write_text(json.dumps(gc))
    k = new.index(new[2])
    rc, out, err = run(capsys, "generate", "--model", d, "--prompt", PROMPT, "--max-new-tokens", N_NEW)
    assert rc == 0, err
    assert out == tok.decode(new[:k], skip_special_tokens=True)
    assert f"new tokens {k + 1} (stopped by an EOS token)" in err


def test_stop_string_ends_generation(ckpt, greedy, capsys):
    path, tok, _ = ckpt
    full = tok.decode(greedy[1], skip_special_tokens=True)
    stop = full[-3:-1]
    cut = full.find(stop)
    assert cut > 0
    rc, out, err = run(capsys, "generate", "--model", path, "--prompt", PROMPT, "--max-new-tokens", N_NEW,
                       "--stop", stop, "--stop", "never printed")
    assert rc == 0, err
    assert out == full[:cut] and stop not in out
    assert "(stopped by a --stop string)" in err


def test_text_stream_keeps_multibyte_characters_whole(ckpt):
    """Byte-level tokens split a character the BPE never merged: no piece holds half of one (no
    U+FFFD), the pieces add up to the text, and a stop string is never printed, not even in part."""
    tok = ckpt[1]
    text = "Déjà 語 café 漢字 ñandú, the end"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    s = TextStream(tok)
    pieces = [s.push(t) for t in ids]
    assert "" in pieces                                        # a token ended inside a character
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + s.finish() == text == s.text
    s = TextStream(tok, stop=["漢字 ñ", "zzz"])
    pieces = [s.push(t) for t in ids]
    assert s.stopped and "".join(pieces) + s.finish() == "Déjà 語 café " == s.text
    assert not any(p.endswith(("漢", "漢字", "漢字 ")) for p in pieces)   # the stop's start was held back


# ---- the distribution of SAMPLE's draws ----------------------------------------------------------
T, TOP_K, TOP_P, POS = 1.5, 20, 0.9, 5
N_DRAWS, N_DEVICE = 2000, 24
N_DEVICE_DEFAULT = 8      # the device's draws in the default run (a launch each); --runslow: N_DEVICE


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax after transformers' temperature, top-k and top-p warpers (in generate's order)."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    s = logits.reshape(1, -1).float().clone()
    for w in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)):
        s = w(None, s)
    return torch.softmax(s, dim=-1)[0].double()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs``; tokens expected fewer than 5
    times share one bin (folded into the smallest bin if that one is still under 5)."""
    n = float(counts.sum())
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = counts[big].double().tolist(), exp[big].tolist()
    rest_o, rest_e = float(counts[~big & (probs > 0)].sum()), float(exp[~big].sum())
    if rest_e >= 5:
        obs_b.append(rest_o)
        exp_b.append(rest_e)
    elif rest_e > 0:
        j = min(range(len(exp_b)), key=exp_b.__getitem__)
        obs_b[j] += rest_o
        exp_b[j] += rest_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    df = len(exp_b) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


class OneSample:
    """The interpreter kernel of a sampling decoder with a one-instruction queue (SAMPLE; one
    instruction of every other opcode of the program after it, never run): the device function
    on given logits, LM head partials and parameters."""

    def __init__(self, c: Checkpoint, h):
        prog = lower_decoder(h.lay, sample=True)
        first = [i for i in prog.instrs if isinstance(i, Sample)][:1]
        reps = first + [next(i for i in prog.instrs if type(i) is k) for k in prog.classes() if k is not Sample]
        words = torch.tensor([[i.OPCODE, NO_COUNTER, 0, NO_COUNTER, 0, NO_COUNTER] + list(i.operands()) +
                              [0] * (WORDS - HEADER - len(i.operands())) for i in reps], dtype=torch.int32)
        tape = Tape(h.lay, 1, words, torch.tensor([0, 1, 1], dtype=torch.int32), [])
        cfg = h.cfg
        kv = [tuple(torch.zeros(1, cfg.n_kv, h.max_seq, cfg.hd, dtype=torch.bfloat16) for _ in range(2))
              for _ in range(cfg.layers)]
        self.h = build_layer(c.load_weights(), kv, cfg, h.max_seq, tape=tape, verify_tape=False)
        self.x = torch.zeros(1, cfg.d, dtype=torch.bfloat16)

    def draw(self, logits, amax, smp, pos: int) -> int:
        h = self.h
        h.scratch["logits"].copy_(logits)
        h.scratch["amax"].copy_(amax)
        h.state["smp"].copy_(smp)
        launch(h, self.x, pos, torch.empty_like(self.x))
        h.check()
        assert int(h.state["tok"][0]) == int(h.state["toks"][pos])
        return int(h.state["tok"][0])


def test_sampled_tokens_follow_the_transformers_distribution(sampler, greedy, runslow):
    c, h = sampler
    ids = greedy[0]
    for p, t in enumerate(ids):
        decode_step(h, t, p)
    logits = decode_step(h, greedy[1][0], len(ids))[0]              # the logits of one real step
    amax = h.layer.scratch["amax"].clone()
    want = hf_probs(logits, T, TOP_K, TOP_P)
    kept = int((want > 0).sum())
    assert 8 <= kept < TOP_K, f"{kept} tokens kept: pick T / top-k / top-p that keep a spread"
    lay = h.lay
    args = (lay.n_lm_tiles, lay.lm_rows, Sample.CONSTEXPRS["SMP_BLOCK"](lay))
    smp = [Sample.state_values(T, TOP_K, TOP_P, seed)["smp"] for seed in range(N_DRAWS)]
    draws = [sample_torch(logits, amax, *args, smp[s], POS) for s in range(N_DRAWS)]
    # the device function draws the same tokens (bit for bit: exact integer weights), and so does
    # the opcode's run_torch in the VM
    one = OneSample(c, h)
    n_dev = N_DEVICE if runslow else N_DEVICE_DEFAULT
    try:
        dev = [one.draw(logits, amax, smp[s], POS) for s in range(n_dev)]
    finally:
        teardown(one.h)
    assert dev == draws[:n_dev]
    st = VMState(lay, c.load_weights(), [], torch.zeros(1), POS, [SampleMass, Sample], state={"smp": smp[0]})
    st.buf["logits"], st.buf["amax"] = logits.clone(), amax.clone()
    Sample(lay.n_lm_tiles).run_torch(lay, st)
    assert st.next_token == draws[0]
    # every draw is in transformers' kept set, and the counts follow its probabilities
    counts = torch.bincount(torch.tensor(draws), minlength=want.numel())
    assert int(counts[want == 0].sum()) == 0, "a token outside the top-k / top-p set was drawn"
    p = chi2_pvalue(counts, want)
    assert p > 1e-3, f"chi-square p = {p:.2e} against softmax(logits / {T}) with top-k {TOP_K}, top-p {TOP_P}"
    # the test can fail: the same draws against a 1.3x temperature are rejected
    wrong = hf_probs(logits, 1.3 * T, TOP_K, TOP_P)
    assert chi2_pvalue(counts, wrong) < 1e-3


def test_a_sampling_tape_runs_in_the_vm(sampler, greedy):
    """The whole sampling tape in the tape VM: the parameters are its STATE, given to run_tape."""
    from schedule import compile_model
    from schedule.decoder_program import decoder_lowering, run_decoder_vm
    from schedule.vm import run_tape
    c, h = sampler
    w = c.load_weights()
    tape = compile_model(h.cfg, 3, max_seq=16, lowering=decoder_lowering(lm_rows=h.lay.lm_rows, sample=True)).tape
    kv = [tuple(torch.zeros(1, h.cfg.n_kv, 16, h.cfg.hd, dtype=torch.bfloat16) for _ in range(2))
          for _ in range(h.cfg.layers)]
    prm = dict(temperature=T, top_k=TOP_K, top_p=TOP_P, seed=5)
    logits, tok = run_decoder_vm(tape, w, kv, greedy[0][0], 0, seed=1, sampling=prm)
    st = run_tape(tape, w, [tuple(t.clone() for t in p) for p in kv], torch.tensor([greedy[0][0]]), 0, seed=2,
                  return_state=True, state=Sample.state_values(**prm))
    lay = tape.lay
    assert tok == sample_torch(st.buf["logits"], st.buf["amax"], lay.n_lm_tiles, lay.lm_rows,
                               Sample.CONSTEXPRS["SMP_BLOCK"](lay), Sample.state_values(**prm)["smp"], 0)
    assert torch.equal(logits[0], st.buf["logits"])              # another interleaving, the same logits
    with pytest.raises(ValueError, match="sampling parameters"):
        run_decoder_vm(tape, w, kv, greedy[0][0], 0)


@triton.jit
def _randint_kernel(seed_ptr, out_ptr, pos):
    tl.store(out_ptr, tl.randint(tl.load(seed_ptr), pos))


def test_philox_matches_tl_randint():
    for seed, pos in ((0, 0), (1, 5), (12345, 63), (2**31 - 1, 4095), (7, 2**20 + 3)):
        out = torch.zeros(1, dtype=torch.int32)
        _randint_kernel[(1,)](torch.tensor([seed], dtype=torch.int32), out, pos)
        assert int(out[0]) & 0xFFFFFFFF == philox_randint(seed, pos), (seed, pos)


# ---- bad input: clear errors, nothing half-done -----------------------------------------------------
def _no_tokenizer(src, tmp):
    return _copy(src, tmp / "ck", drop=("tokenizer.json",))


def _not_llama(src, tmp):
    d = _copy(src, tmp / "ck")
    conf = json.loads((d / "config.json").read_text())
    conf["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(conf))
    return d


def _no_chat_template(src, tmp):
    d = _copy(src, tmp / "ck", drop=("chat_template.jinja",))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


# (case, checkpoint edit, extra arguments, substrings of the one error line)
CLI_ERRORS = [
    ("no-directory", lambda src, tmp: tmp / "no-such-dir", [], ["--model", "no-such-dir", "no such directory"]),
    ("no-tokenizer", _no_tokenizer, [], ["--model", "tokenizer.json"]),
    ("not-llama", _not_llama, [], ["--model", "model_type 'gpt2'", "config.json"]),
    ("no-chat-template", _no_chat_template, ["--chat"], ["--chat", "no chat template"]),
    ("prompt-too-long", lambda src, tmp: src, ["--max-seq", 1], ["prompt", "2 tokens", "context of 1", "--max-seq"]),
    ("max-seq-past-context", lambda src, tmp: src, ["--max-seq", MAX_POS + 1],
     ["--max-seq", f"{MAX_POS + 1} is past the model's context of {MAX_POS}"]),
    ("empty-stop", lambda src, tmp: src, ["--stop", ""], ["--stop", "non-empty"]),
    ("negative-temperature", lambda src, tmp: src, ["--temperature", -1], ["--temperature", ">= 0", "-1"]),
    ("top-p-zero", lambda src, tmp: src, ["--top-p", 0], ["--top-p", "(0, 1]"]),
    ("top-p-above-one", lambda src, tmp: src, ["--top-p", 1.5], ["--top-p", "(0, 1]", "1.5"]),
    ("negative-top-k", lambda src, tmp: src, ["--top-k", -1], ["--top-k", ">= 0"]),
    ("prompt-and-file", lambda src, tmp: src, ["--prompt-file", "x"], ["--prompt-file", "not allowed"]),
    ("missing-prompt-file", lambda src, tmp: src, ["--prompt-file", "/no/such/file"], ["--prompt-file", "/no/such/file"]),
]


@pytest.mark.parametrize("case,edit,extra,names", CLI_ERRORS, ids=[c[0] for c in CLI_ERRORS])
def test_cli_errors_are_one_line(ckpt, capsys, tmp_path, case, edit, extra, names):
    d = edit(ckpt[0], tmp_path)
    prompt = [] if case == "missing-prompt-file" else ["--prompt", PROMPT]
    rc, out, err = run(capsys, "generate", "--model", d, *prompt, *extra)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("megatape generate: error: "), err
    for s in names:
        assert s in err, (s, err)


def test_api_errors_name_the_argument_and_run_nothing(sampler, greedy):
    c, h = sampler
    g = c.build(16, sampling=False)
    ids = greedy[0]
    try:
        bad = [(h, dict(temperature=-1.0), ValueError, "temperature"),
               (h, dict(temperature=float("nan")), ValueError, "temperature"),
               (h, dict(temperature=1.0, top_p=0.0), ValueError, "top_p"),
               (h, dict(temperature=1.0, top_p=1.5), ValueError, "top_p"),
               (h, dict(temperature=1.0, top_k=-1), ValueError, "top_k"),
               (h, dict(temperature=1.0, seed=-1), ValueError, "seed"),
               (h, dict(temperature=1.0, eos_token_ids="x"), TypeError, "eos_token_ids"),
               (h, dict(temperature=0.0), ValueError, "temperature"),       # greedy needs ARGMAX
               (g, dict(temperature=0.7), ValueError, "sampling=True"),    # sampling needs SAMPLE
               (h, dict(temperature=1.0, n_new=40), ValueError, "max_seq_len"),
               (h, dict(temperature=1.0, graph_block=8), ValueError, "graph_block"),   # no CUDA graphs on a CPU
               (g, dict(graph_block="8"), TypeError, "graph_block")]
        for handle, kw, exc, name in bad:
            n_new = kw.pop("n_new", 4)
            before = (handle.layer.ctl.clone(), handle.layer.state["smp"].clone() if handle.sampling else None)
            with pytest.raises(exc, match=name):
                generate(handle, ids, n_new, **kw)
            assert torch.equal(handle.layer.ctl, before[0]), "a launch ran"    # the device's call count
            if handle.sampling:
                assert torch.equal(handle.layer.state["smp"], before[1]), "the parameters changed"
    finally:
        teardown(g.layer)
    with pytest.raises(TypeError, match="sampling"):
        build_decoder(c.load_weights(), [], c.cfg, 16, sampling="yes")


# the cases (below) each block / chunk size draws in the default run: (8192, 2048), where chunks of two
# sub-blocks merge their candidates, all nine; the others temperature alone (the mass path), a candidates
# case, a whole-vocabulary case, a tie and the masked block (--runslow: all nine everywhere)
@pytest.mark.parametrize("block,min_chunk,default_cases", [(1024, 1024, (0, 1, 5, 6, 8)), (8192, 1024, (0, 2, 4, 7, 8)),
                                                           (8192, 2048, None)],
                         ids=["1024-1024", "8192-1024", "8192-2048"])
def test_sample_device_over_several_blocks(monkeypatch, runslow, block, min_chunk, default_cases):
    """SAMPLE's device function on a 20000-token vocabulary (several blocks of SMP_BLOCK logits,
    blocks skipped by their partials' maxima) draws what ``sample_torch`` draws, for temperature
    alone, top-k and top-p, whatever the block size and the chunk size (the draw does not depend on them;
    chunks of two sub-blocks merge their candidates).

    Each case is one kernel launch (~1 s in the interpreter): the default run draws once per case, its
    seed taking turns over 0, 1, 2 from case to case, and each block / chunk size draws the cases of
    ``default_cases`` (every case, every seed and each path of the draw still run at every size);
    ``--runslow`` draws every case at every size with all three seeds."""
    import opcodes.sample as smp_mod
    from conftest import decoder_weights
    from opcodes import DecoderLayout, ModelConfig, Tiling
    monkeypatch.setattr(smp_mod, "SMP_MAX_BLOCK", block)
    # chunks of 2048: two sub-blocks of 1024 each, so SAMPLE_MASS merges its candidates across them
    monkeypatch.setattr(smp_mod, "SMP_MIN_CHUNK", min_chunk)
    cfg = ModelConfig(layers=1, d=64, ffn=128, n_q=2, n_kv=1, hd=32, theta=10000.0, vocab=20000, name="v20k")
    lay = DecoderLayout(cfg, Tiling.for_config(cfg), 8, lm_rows=256)
    assert Sample.CONSTEXPRS["SMP_BLOCK"](lay) == block and chunk_size(lay) == min_chunk
    prog = lower_decoder(lay, sample=True)
    # one SM runs the SAMPLE_MASS stage, then SAMPLE; one instruction of every other opcode follows
    # (never run: the kernel is the sampling decoder's)
    run = [i for i in prog.instrs if isinstance(i, SampleMass)] + [next(i for i in prog.instrs if isinstance(i, Sample))]
    ch = chunk_size(lay)
    assert len(run) == 1 + -(-cfg.vocab // ch) > 2
    reps = run + [next(i for i in prog.instrs if type(i) is k) for k in prog.classes() if k not in (Sample, SampleMass)]
    words = torch.tensor([[i.OPCODE, NO_COUNTER, 0, NO_COUNTER, 0, NO_COUNTER] + list(i.operands()) +
                          [0] * (WORDS - HEADER - len(i.operands())) for i in reps], dtype=torch.int32)
    tape = Tape(lay, 1, words, torch.tensor([0, len(run), len(run)], dtype=torch.int32), [])
    kv = [tuple(torch.zeros(1, 1, 8, 32, dtype=torch.bfloat16) for _ in range(2))]
    h = build_layer(decoder_weights(cfg, seed=1), kv, cfg, 8, tape=tape, verify_tape=False)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(cfg.vocab, generator=g) * 2.0
    logits[torch.randint(0, cfg.vocab, (40,), generator=g)] += 6.0        # a peaked head across blocks

    def partials(lg):          # the LM head tiles' (max, index) partials
        return torch.tensor([[float(p.max()), float(r0 + int(torch.argmax(p)))] for r0, p in
                             zip(range(0, cfg.vocab, 256), lg.split(256))]).reshape(-1)

    amax = partials(logits)
    assert amax.numel() == 2 * lay.n_lm_tiles      # the last tile is short (20000 = 78 x 256 + 32)
    x = torch.zeros(1, cfg.d, dtype=torch.bfloat16)
    paths = set()
    try:
        # the last case: logits 1024..2047 all -inf (a whole block at SMP_BLOCK 1024: SAMPLE_MASS's
        # chunk there is skipped by its partials' maximum, and weighs 0)
        masked = logits.clone()
        masked[1024:2048] = float("-inf")
        # the whole-vocabulary path: one chunk holds the top 40 (more than its candidates), or top-p
        # keeps thousands of nearly flat logits
        clustered = logits.clone()
        clustered[3000:3040] += 9.0
        flat = torch.randn(cfg.vocab, generator=g) * 0.05
        # top-k 2 over three equal logits in three chunks: all three kept (ties), all at the threshold
        tied = logits.clone()
        tied[[100, 5000, 15000]] = 30.0
        cases = ((dict(temperature=0.9), logits), (dict(temperature=0.7, top_k=30), logits),
                 (dict(temperature=1.1, top_p=0.8), logits),
                 (dict(temperature=1.0, top_k=200, top_p=0.9), logits),
                 (dict(temperature=0.7, top_k=30), clustered), (dict(temperature=1.0, top_p=0.9), flat),
                 (dict(temperature=1.0, top_k=2), tied), (dict(temperature=1.0, top_k=2, top_p=0.5), tied),
                 (dict(temperature=1.3), masked))
        for case, (prm, logits) in enumerate(cases):
            if not runslow and default_cases is not None and case not in default_cases:
                continue
            amax = partials(logits)
            for seed in (range(3) if runslow else [case % 3]):
                smp = Sample.state_values(seed=seed, **prm)["smp"]
                want = sample_torch(logits, amax, lay.n_lm_tiles, lay.lm_rows, block, smp, 5)
                assert want == sample_torch(logits, amax, lay.n_lm_tiles, lay.lm_rows, 512, smp, 5), prm
                h.scratch["logits"].copy_(logits)
                h.scratch["amax"].copy_(amax)
                h.state["smp"].copy_(smp)
                launch(h, x, 5, torch.empty_like(x))
                h.check()
                assert int(h.state["tok"][0]) == want, (prm, seed)
                sums = [chunk_mass_torch(logits, amax, lay.n_lm_tiles, lay.lm_rows, block, ch, smp, i.c0)
                        for i in run[:-1]]
                words = h.scratch["smp_mass"]
                assert words[:len(sums)].tolist() == sums, prm            # exact int64 sums
                if ch == 1024:                  # the masked logits are chunk 1, which weighs 0
                    assert (sums[1] == 0) == (logits is masked), sums
                k, n = n_cands(lay), len(sums)
                if wants_cands(smp, cfg.vocab):     # each chunk's k largest logits and their weights
                    both = [chunk_cands_torch(logits, amax, lay.n_lm_tiles, lay.lm_rows, block, ch, k, smp, i.c0)
                            for i in run[:-1]]
                    got = words[n:n * (1 + k)].to(torch.int32).view(torch.float32).view(n, k)
                    assert torch.equal(got, torch.stack([v for v, _ in both])), prm
                    assert torch.equal(words[n * (1 + k):-1].view(n, k), torch.stack([w for _, w in both])), prm
                path = int(words[-1])
                assert path == cand_path_torch(logits, amax, lay.n_lm_tiles, lay.lm_rows, block, ch, k, smp), prm
                paths.add((prm.get("top_k", 0) > 0 or "top_p" in prm, path))
        # both paths ran, each where its torch twin says
        assert {(False, 0), (True, 1), (True, 2)} <= paths, paths
    finally:
        teardown(h)
