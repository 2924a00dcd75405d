"""Nothing opd puts in the temp dir outlives its owner: a process that merges through mergekit's
run_merge, scores with lm-eval, saves a policy copy for an SGLang server and launches servers (one
that comes up, one that dies at start, one whose handle nobody closes) leaves no `opd-*` entry in
$TMPDIR once it has exited, although each was there while it ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

RUN = """
import socket, sys, tempfile
from pathlib import Path

import torch
from sglang_stub import Stub, serve
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.errors import OpdError
from opd.evaluation.api import evaluate
from opd.lab.pico import build_fake_lab
from opd.rollout.sglang import SGLangEngine, launch_server
from opd.weights.merge import Candidate, merge_candidate, merge_keys

torch.set_num_threads(1)
work, ok, dies = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lab = build_fake_lab(work / "lab")
sds = {n: merge_keys(AutoModelForCausalLM.from_pretrained(p).state_dict())
       for n, p in [("base", lab["base"]), *lab["experts"].items()]}
experts = list(lab["experts"])
cand = Candidate(strategy="dare_ties", per_model={e: {"weight": 0.9, "density": 0.5} for e in experts}, seed=1)
merge_candidate(cand, str(lab["base"]), {e: str(lab["experts"][e]) for e in experts}, sds["base"],
                {e: sds[e] for e in experts})  # a randomised method: mergekit's run_merge into a temp dir

model, tok = AutoModelForCausalLM.from_pretrained(lab["base"]), AutoTokenizer.from_pretrained(lab["base"])
evaluate(model, tok, ["add"], "val", limit=4)

stub = Stub([5, 1], vocab_size=model.config.vocab_size)
server = serve(stub)
engine = SGLangEngine(f"http://127.0.0.1:{server.server_address[1]}", tok, model=model)
engine.sync_weights(model)  # a temp policy copy, held until the engine goes (here: at exit)


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


with launch_server(work, port(), python=ok, timeout_s=30):
    pass
try:
    launch_server(work, port(), python=dies, timeout_s=30)
    raise SystemExit("a server that exits at start was not reported")
except OpdError:
    pass
handle = launch_server(work, port(), python=ok, timeout_s=30)  # never closed
handle.process.kill()
handle.process.wait()
print("during:", " ".join(sorted(p.name for p in Path(tempfile.gettempdir()).iterdir())))
"""


def test_a_process_leaves_no_opd_temp_entry_behind(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ok, dies = tmp_path / "python-ok", tmp_path / "python-dies"
    ok.write_text(f"#!/bin/sh\nexec {sys.executable} {TESTS / 'sglang_stub.py'} \"$@\"\n")
    dies.write_text("#!/bin/sh\necho 'no CUDA device' >&2\nexit 3\n")
    ok.chmod(0o755)
    dies.chmod(0o755)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    res = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), str(ok), str(dies)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    during = next(line for line in res.stdout.splitlines() if line.startswith("during:")).split()[1:]
    # while it ran: the policy copy and the unclosed server's log; the closed and the failed server's
    # logs and mergekit's output were gone already
    mine = [n for n in during if n.startswith("opd-")]
    weights, logs = [n for n in mine if n.startswith("opd-sglang-weights-")], [n for n in mine if n.endswith(".log")]
    assert len(weights) == len(logs) == 1 and len(mine) == 2, during
    left = sorted(p.name for p in tmp.iterdir())
    assert not [n for n in left if n.startswith("opd-")], left
