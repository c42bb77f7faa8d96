"""The speculative proposer seam on the worker side (pagedkv/worker/proposer.py): the
registry maps names to classes (one line per proposer), the worker runs its proposer after a
step and drops an aborted request's state, a worker without one proposes nothing, and the
n-gram proposer answers every row (no model)."""

from types import SimpleNamespace

import pytest

from pagedkv.errors import ConfigError
from pagedkv.worker.ngram_proposer import NgramProposer
from pagedkv.worker.proposer import PROPOSERS, DraftRequest, Proposer, parse_speculative
from pagedkv.worker.worker import Worker


class _Recorder(Proposer):
    k = 2

    def __init__(self):
        self.calls = []

    def propose(self, rows):
        self.calls.append(("propose", [tuple(r) for r in rows]))
        return {r.request_id: [7] * r.max_drafts for r in rows}

    def release(self, request_id):
        self.calls.append(("release", request_id))


def test_registry_names_one_class_per_proposer():
    assert PROPOSERS == {"ngram": "pagedkv.worker.ngram_proposer:NgramProposer",
                         "draft": "pagedkv.worker.draft_proposer:DraftModelProposer"}
    assert parse_speculative("ngram") == (NgramProposer, None)
    cls, arg = parse_speculative("draft:/m/x.gguf")
    assert cls.__name__ == "DraftModelProposer" and issubclass(cls, Proposer) and arg == "/m/x.gguf"
    for bad, msg in (("eagle", "'ngram' \\(prompt lookup\\)"), ("draft:  ", "needs a model path"), (3, "got 3")):
        with pytest.raises(ConfigError, match=msg):
            parse_speculative(bad)


def test_the_worker_runs_its_proposer_after_a_step_and_forgets_aborted_requests():
    w = Worker(model=None, config=SimpleNamespace(), backend=None)
    assert w.propose_drafts([DraftRequest("a", [1, 2], 2)]) == {}  # speculation off
    w.finish_requests(["a"])  # no proposer: nothing to drop
    p = _Recorder()
    w.attach_proposer(p)
    rows = [DraftRequest("a", [1, 2, 1], 2), DraftRequest("b", [5], 0)]
    assert w.propose_drafts(rows) == {"a": [7, 7], "b": []}
    assert w.propose_drafts([]) == {}  # nothing running: the proposer still hears it (frees state)
    w.finish_requests(["b", "c"])
    assert p.calls == [("propose", [("a", [1, 2, 1], 2, ()), ("b", [5], 0, ())]), ("propose", []),
                       ("release", "b"), ("release", "c")]


def test_ngram_answers_every_row_within_its_max():
    p = NgramProposer(k=3)
    rows = [DraftRequest("a", [1, 2, 3, 9, 1, 2], 3), DraftRequest("b", [1, 2, 3, 9, 1, 2], 1),
            DraftRequest("c", [1, 2, 3, 9, 1, 2], 0), DraftRequest("d", [4, 5], 3)]
    assert p.propose(rows) == {"a": [3, 9, 1], "b": [3], "c": [], "d": []}
    p.release("a")  # stateless: a no-op
