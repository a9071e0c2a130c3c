"""The run loop's own logic, on the fake engine and real SQLite: resume, retries, failures, stats."""
from __future__ import annotations

import json
import sqlite3

import jsonschema
import pyarrow.parquet as pq
import pytest

from runner.engines.base import Completion
from runner.engines.fake import FakeEngine, example_for_schema
from runner.errors import EngineError
from runner.run import run_job
from runner.spec import load_job
from tests.conftest import SCHEMA


def results(job):
    con = sqlite3.connect(job.database_path)
    con.row_factory = sqlite3.Row
    return {r["row_id"]: dict(r) for r in con.execute("SELECT * FROM results")}


def test_every_row_is_stored_once_with_stats(make_job):
    job = load_job(make_job(rows=12))
    engines = []

    def factory(j):
        engines.append(FakeEngine(j.output_schema))
        return engines[-1]

    s = run_job(job, engine_factory=factory)
    rows = results(job)
    assert sorted(rows) == [f"r{i:03d}" for i in range(12)]
    assert all(r["status"] == "ok" and r["run_id"] == s.run_id for r in rows.values())
    for r in rows.values():
        jsonschema.validate(json.loads(r["extraction_json"]), SCHEMA)
    # Grouped order: every SYSTEM_A row reached the engine before any SYSTEM_B row.
    keys = [r.group_key for r in engines[0].seen]
    assert keys == sorted(keys, key=keys.index) and len(set(keys)) == 2
    assert s.stats["rows_total"] == 12 and s.stats["rows_ok"] == 12
    assert s.stats["prefix_cache_hits"] > 0 and 0 < s.stats["prefix_cache_hit_rate"] < 1
    assert 0.5 < s.stats["plan_prefix_share"] < 1  # long system prompts, short documents
    con = sqlite3.connect(job.database_path)
    assert con.execute("SELECT status FROM runs").fetchall() == [("completed",)]
    assert con.execute("SELECT count(*) FROM run_stats").fetchone()[0] == 1


def test_rerun_skips_finished_rows_and_restart_redoes_them(make_job):
    job = load_job(make_job(rows=10))
    first = run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema))
    seen = []

    def factory(j):
        e = FakeEngine(j.output_schema)
        seen.append(e)
        return e

    again = run_job(job, engine_factory=factory)
    assert seen == [] and again.rows_skipped == 10 and again.stats["rows_total"] == 0  # no engine started
    assert {r["run_id"] for r in results(job).values()} == {first.run_id}
    redo = run_job(job, engine_factory=factory, restart=True)
    assert len(seen[0].seen) == 10 and {r["run_id"] for r in results(job).values()} == {redo.run_id}


def test_restart_sets_the_stored_rows_aside_and_their_run_still_shows_them(make_job, tmp_path):
    """--restart with --limit sets aside only the rows it redoes: the rest stay done."""
    from runner.export import export_run
    from runner.store import Store

    path = make_job(rows=10)
    job = load_job(path)
    first = run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema))
    redo = run_job(load_job(path, ["input.limit=3"]), engine_factory=lambda j: FakeEngine(j.output_schema),
                   restart=True)
    assert redo.stats["rows_total"] == 3 and redo.rows_redone == 3  # stored before: "rows run again"
    made_by = [r["run_id"] for r in results(job).values()]
    assert made_by.count(redo.run_id) == 3 and made_by.count(first.run_id) == 7  # only the rows it took
    store = Store(job.database_path)
    assert store.result_counts(first.run_id) == ({"ok": 10}, 0)
    out = tmp_path / "first.csv"
    assert export_run(store, first.run_id, "csv", out) == 10
    *groups, history = store.rows_by_fingerprint(job.name)
    assert history["history_rows"] == 3 and sum(g["rows"] for g in groups) == 10
    assert store.rows_replaced_by(redo.run_id) == 3  # each moved to the history as its new result was stored
    again = run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema))
    assert again.rows_skipped == 10 and again.stats["rows_total"] == 0  # nothing left undone by the smoke run


def test_bad_outputs_are_stored_with_status_and_error(make_job):
    job = load_job(make_job(rows=6))
    answers = {
        "r000": '{"summary": "fine", "sentiment": "neutral"}',
        "r001": '{"summary": "cut',
        "r002": "not json",
        "r003": '{"summary": "x", "sentiment": "angry"}',
    }
    engine = FakeEngine(SCHEMA, respond=lambda r: answers.get(r.row_id, '{"summary": "s", "sentiment": "positive"}'),
                        finish_reason=lambda r: "length" if r.row_id == "r001" else "stop")
    s = run_job(job, engine_factory=lambda j: engine)
    rows = results(job)
    assert rows["r000"]["status"] == "ok"
    assert rows["r001"]["status"] == "truncated" and "max_tokens=64" in rows["r001"]["error"]
    assert rows["r002"]["status"] == "invalid_json" and rows["r002"]["extraction_json"] is None
    assert rows["r003"]["status"] == "schema_mismatch" and "sentiment" in rows["r003"]["error"]
    assert rows["r003"]["output_text"] == answers["r003"]
    assert s.counts == {"ok": 3, "truncated": 1, "invalid_json": 1, "schema_mismatch": 1, "failed": 0}


def test_retry_once_with_larger_budget_when_enabled(make_job):
    job = load_job(make_job(rows=4, job={"sampling": {"max_tokens": 64, "retry_max_tokens": 200}}))
    budgets: dict[str, list[int]] = {}

    def respond(r):
        budgets.setdefault(r.row_id, []).append(r.max_tokens)
        if r.row_id == "r001" and r.max_tokens < 200:
            return '{"summary": "cut'  # fixed by the larger budget
        if r.row_id == "r002":
            return "never json"  # fails both times
        return '{"summary": "s", "sentiment": "positive"}'

    run_job(job, engine_factory=lambda j: FakeEngine(SCHEMA, respond=respond))
    rows = results(job)
    assert budgets["r001"] == [64, 200] and budgets["r002"] == [64, 200] and budgets["r000"] == [64]
    assert (rows["r001"]["status"], rows["r001"]["attempts"], rows["r001"]["first_status"]) == ("ok", 2, "invalid_json")
    assert (rows["r002"]["status"], rows["r002"]["attempts"], rows["r002"]["first_status"]) == ("invalid_json", 2, "invalid_json")
    assert (rows["r000"]["attempts"], rows["r000"]["first_status"]) == (1, None)
    # a retry sends its prompt again, all of it cached: the plan's bound counts it too, so that
    # the run's hit rate never exceeds its bound
    con = sqlite3.connect(job.database_path)
    hit, bound = con.execute("SELECT prefix_cache_hit_rate, plan_prefix_share FROM run_stats").fetchone()
    assert 0 < hit <= bound


def test_a_retry_budget_stops_at_what_max_model_len_leaves(make_job, tmp_path):
    """vLLM stops a request at max_model_len whatever its max_tokens: a retry's budget is held to the
    room the prompt leaves, and a retry that could not write a token more, with no penalty to
    change its output, is not made."""
    from tests.conftest import write_docs
    import pyarrow as pa

    docs = write_docs(tmp_path / "data" / "long.parquet", 2)
    t = pq.read_table(docs).to_pydict()
    t["text"][1] = "word " * 3000  # cut to fit: the prompt leaves max_tokens and a few more
    pq.write_table(pa.table(t), docs)
    budgets: dict[str, list[int]] = {}

    def respond(r):
        budgets.setdefault(r.row_id, []).append((r.max_tokens, len(r.prompt_token_ids)))
        return '{"summary": "cut'

    for name, penalty in (("t", None), ("p", 1.2)):
        job = load_job(make_job(docs=docs, job={"name": name, "input": {"on_too_long": "truncate"}, "sampling": {
            "temperature": 0, "max_tokens": 64, "retry_max_tokens": 700, "retry_repetition_penalty": penalty}}))
        budgets.clear()
        run_job(job, engine_factory=lambda j: FakeEngine(SCHEMA, respond=respond))
        assert [b for b, _ in budgets["r000"]] == [64, 700]  # a short prompt: the whole retry budget
        (first, prompt), *retry = budgets["r001"]
        room = 1024 - prompt
        assert first == 64 < room < 700
        assert [b for b, _ in retry] == ([room] if room > 64 or penalty else [])
        assert results(job)["r001"]["attempts"] == 1 + len(retry)


def test_no_retry_where_the_prompt_leaves_no_more_room_and_nothing_else_changes():
    from types import SimpleNamespace

    from runner.outputs import Checked, retry_tokens
    from runner.rows import Status

    cut = Checked(Status.INVALID_JSON, None, "not valid JSON")
    plain, penalised = (SimpleNamespace(retry_max_tokens=700, retry_repetition_penalty=p) for p in (None, 1.2))
    assert retry_tokens(cut, 1, 64, plain, room=64) is None  # the same budget, the same greedy output
    assert retry_tokens(cut, 1, 64, penalised, room=64) == 64  # the penalty may change it
    assert retry_tokens(cut, 1, 64, plain, room=65) == 65 and retry_tokens(cut, 1, 64, plain, room=None) == 700
    assert retry_tokens(cut, 2, 64, plain, room=900) is None  # one retry only


def test_a_document_longer_than_any_prompt_is_cut_before_it_is_tokenized(make_job, tmp_path, monkeypatch):
    """A huge row (a log file, a whole book) is too long whatever it says: tokenizing all of it took
    gigabytes to store it failed. Only the characters a prompt could hold are tokenized."""
    import pyarrow as pa

    from runner.prompting import PromptBuilder
    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "huge.parquet", 3)
    t = pq.read_table(docs).to_pydict()
    t["text"][1] = "word " * 400_000  # 2,000,000 characters
    pq.write_table(pa.table(t), docs)
    longest = []
    encode, encode_batch = PromptBuilder.encode, PromptBuilder.encode_batch
    monkeypatch.setattr(PromptBuilder, "encode", lambda self, text: longest.append(len(text)) or encode(self, text))
    monkeypatch.setattr(PromptBuilder, "encode_batch",
                        lambda self, texts: longest.extend(map(len, texts)) or encode_batch(self, texts))

    job = load_job(make_job(docs=docs))
    cap = (1024 + 1) * PromptBuilder(job.model_path).max_token_chars * 4
    assert cap < 2_000_000
    run_job(job, engine_factory=lambda j: FakeEngine(SCHEMA))
    rows = results(job)
    assert rows["r001"]["status"] == "failed" and rows["r001"]["error"] == (
        "the document is 2,000,000 characters, more than max_model_len=1024 tokens can hold "
        "(set input.on_too_long: truncate to cut it)")
    assert rows["r000"]["status"] == rows["r002"]["status"] == "ok"
    assert max(longest) < cap + 1000  # the document's first `cap` characters and the template's few

    longest.clear()
    job2 = load_job(make_job(docs=docs, job={"name": "t2", "input": {"on_too_long": "truncate"}}))
    seen = FakeEngine(SCHEMA)
    run_job(job2, engine_factory=lambda j: seen)
    cut = results(job2)["r001"]
    assert cut["status"] == "ok" and cut["document_tokens_cut"] > 1024  # at least: of the part tokenized
    req = [r for r in seen.seen if r.row_id == "r001"][0]
    assert len(req.prompt_token_ids) + 64 <= 1024 and max(longest) < cap + 1000


def test_a_cut_document_whose_part_fits_is_tokenized_whole_after_all(make_job, tmp_path, monkeypatch):
    """capped()'s bound assumes a token stands for at most max_token_chars characters, 4x for
    normalizers; a tokenizer that drops more (collapsing whitespace) must not see its row cut."""
    import pyarrow as pa

    from runner.prompting import PromptBuilder
    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "spaces.parquet", 2)
    t = pq.read_table(docs).to_pydict()
    t["text"][1] = " sentiment" * 700 + " THE END"  # 7,008 characters in ~700 tokens: one a word
    pq.write_table(pa.table(t), docs)
    monkeypatch.setattr(PromptBuilder, "max_token_chars", 1)  # a cap of (1024 + 1) * 4 characters
    job = load_job(make_job(docs=docs))
    assert len(PromptBuilder(job.model_path).encode(t["text"][1])) < 900  # the whole fits in 1024 - 64
    seen = FakeEngine(SCHEMA)
    run_job(job, engine_factory=lambda j: seen)
    assert results(job)["r001"]["status"] == "ok"
    req = [r for r in seen.seen if r.row_id == "r001"][0]
    assert "THE END" in PromptBuilder(job.model_path).decode(req.prompt_token_ids)


def test_too_long_document_fails_or_is_truncated(make_job, tmp_path):
    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "long.parquet", 3)
    t = pq.read_table(docs).to_pydict()
    t["text"][1] = "word " * 3000
    import pyarrow as pa
    pq.write_table(pa.table(t), docs)

    job = load_job(make_job(docs=docs))
    seen = FakeEngine(SCHEMA)
    run_job(job, engine_factory=lambda j: seen)
    rows = results(job)
    assert rows["r001"]["status"] == "failed" and "exceeds max_model_len=1024" in rows["r001"]["error"]
    assert "set input.on_too_long: truncate to cut the document" in rows["r001"]["error"]  # a cut would save it
    assert [r.row_id for r in seen.seen] == ["r000", "r002"]
    # the row keeps its length (why it failed); the run's token counts and speeds are of what ran
    assert rows["r001"]["prompt_tokens"] > 1024
    con = sqlite3.connect(job.database_path)
    prompt, total_per_s, gen_s, completion = con.execute(
        "SELECT prompt_tokens, total_tokens_per_s, generation_s, completion_tokens FROM run_stats").fetchone()
    con.close()
    assert prompt == rows["r000"]["prompt_tokens"] + rows["r002"]["prompt_tokens"]
    # (generation_s is stored to the millisecond, the rate from the unrounded time)
    assert (prompt + completion) / (gen_s + 0.0005) <= total_per_s <= (prompt + completion) / max(gen_s - 0.0005, 1e-9)

    job2 = load_job(make_job(docs=docs, job={"name": "t2", "input": {"on_too_long": "truncate"}}))
    seen2 = FakeEngine(SCHEMA)
    summary2 = run_job(job2, engine_factory=lambda j: seen2)
    from runner.cli_output import run_summary
    assert summary2.rows_documents_cut == 1
    assert "1 with their document cut to fit (results.document_tokens_cut)" in run_summary(summary2)
    assert "document cut" not in run_summary(run_job(job2, engine_factory=lambda j: FakeEngine(SCHEMA)))  # all done
    long_req = [r for r in seen2.seen if r.row_id == "r001"][0]
    assert len(long_req.prompt_token_ids) + 64 <= 1024
    cut = results(job2)
    assert cut["r001"]["status"] == "ok"
    # the stored row says how much of its document was cut; the others were not cut
    # what was kept and what was cut make the whole prompt the first job stored as too long
    # (within a few tokens: the cut text can re-tokenize differently at the cut)
    whole = len(long_req.prompt_token_ids) + cut["r001"]["document_tokens_cut"]
    assert abs(whole - rows["r001"]["prompt_tokens"]) <= 4, (whole, rows["r001"]["prompt_tokens"])
    assert cut["r000"]["document_tokens_cut"] is None and cut["r002"]["document_tokens_cut"] is None
    assert long_req.document_tokens_cut == cut["r001"]["document_tokens_cut"]
    # a system prompt that does not fit even with the document cut: said so, not "set truncate"
    job3 = load_job(make_job(docs=docs, job={"name": "t3", "input": {"on_too_long": "truncate"},
                                            "sampling": {"temperature": 0, "max_tokens": 1000}}))
    run_job(job3, engine_factory=lambda j: FakeEngine(SCHEMA))
    error = results(job3)["r000"]["error"]
    assert "do not fit even with the document cut" in error and "set input.on_too_long" not in error


def test_rejected_request_becomes_a_failed_row(make_job):
    job = load_job(make_job(rows=3))

    class Rejecting(FakeEngine):
        def generate(self, requests):
            for c in super().generate(requests):
                yield Completion(c.row_id, error="rejected by vLLM: ValueError: bad") if c.row_id == "r001" else c

    s = run_job(job, engine_factory=lambda j: Rejecting(SCHEMA))
    rows = results(job)
    assert rows["r001"]["status"] == "failed" and "rejected" in rows["r001"]["error"]
    assert s.counts["ok"] == 2


def test_engine_that_fails_to_start_marks_the_run_failed(make_job):
    job = load_job(make_job(rows=3))

    def broken(j):
        raise EngineError("vLLM failed to start: out of memory")

    with pytest.raises(EngineError):
        run_job(job, engine_factory=broken)
    con = sqlite3.connect(job.database_path)
    assert con.execute("SELECT status, error FROM runs").fetchall() == [("failed", "vLLM failed to start: out of memory")]
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 0


def test_engine_dying_midway_keeps_finished_rows(make_job):
    job = load_job(make_job(rows=10))

    class Dying(FakeEngine):
        def generate(self, requests):
            for i, c in enumerate(super().generate(requests)):
                if i == 6:
                    raise EngineError("engine died")
                yield c

    with pytest.raises(EngineError):
        run_job(job, engine_factory=lambda j: Dying(SCHEMA))
    assert len(results(job)) == 6  # the partial commit batch was flushed
    run_job(job, engine_factory=lambda j: FakeEngine(SCHEMA))
    assert len(results(job)) == 10


def test_example_for_schema_satisfies_the_sample_schema():
    from tests.conftest import ROOT

    schema = json.loads((ROOT / "schemas" / "summarize.schema.json").read_text())
    jsonschema.validate(example_for_schema(schema, "doc-1"), schema)


class Releases(FakeEngine):
    """Records how it was released: closed (waited for) or let go (the process ends next)."""

    def __init__(self, schema, released: list, fail_after: int = 0):
        super().__init__(schema)
        self.released, self.fail_after, self.polls = released, fail_after, 0

    def poll(self):
        self.polls += 1
        if self.fail_after and self.polls > self.fail_after:
            raise EngineError("vLLM engine failed: lost the device")
        return super().poll()

    def close(self):
        self.released.append("close")

    def let_go(self):
        self.released.append("let_go")


@pytest.mark.parametrize("exits_after, expected", [(True, ["let_go"]), (False, ["close"])])
def test_last_engine_of_a_completed_run_is_let_go_only_when_the_process_ends_next(make_job, exits_after, expected):
    job = load_job(make_job(rows=12))
    released: list = []
    s = run_job(job, engine_factory=lambda j: Releases(j.output_schema, released), exits_after=exits_after)
    assert s.stats["rows_ok"] == 12
    assert released == expected


def test_an_engine_that_fails_is_closed_not_let_go(make_job):
    # The CLI then leaves through the interpreter's exit, which needs the engine shut down.
    job = load_job(make_job(rows=40))
    released: list = []
    with pytest.raises(EngineError):
        run_job(job, engine_factory=lambda j: Releases(j.output_schema, released, fail_after=1), exits_after=True)
    assert released == ["close"]
    assert sqlite3.connect(job.database_path).execute("SELECT status FROM runs").fetchall() == [("failed",)]


def test_restart_with_a_limit_sets_aside_only_the_rows_it_runs_and_refuses_retry_failed(make_job, tmp_path):
    """--restart --limit 2 after a whole run: a smoke run does not empty the job's results. --restart
    with --retry-failed (every row, or only those not ok) is refused before anything is touched."""
    from click.testing import CliRunner

    from runner.cli import cli

    job = make_job(rows=6)
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0
    out = CliRunner().invoke(cli, ["run", "--engine", "fake", "--restart", "--limit", "2", str(job)])
    assert out.exit_code == 0, out.output
    assert ("Note: running 2 stored rows again: --restart set 2 stored rows aside: each stays stored until its "
            "new result replaces it; input.limit: only the rows this run takes") in out.stderr
    db = tmp_path / "out" / "results.sqlite"
    count = lambda table: sqlite3.connect(db).execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: E731
    assert (count("results"), count("results_history")) == (6, 2)
    both = CliRunner().invoke(cli, ["run", "--engine", "fake", "--restart", "--retry-failed", str(job)])
    assert both.exit_code == 2 and both.output == ("Error: --restart and --retry-failed cannot be used together: "
                                                   "--restart runs every row again, --retry-failed only the rows "
                                                   "that are not ok\n")
    assert (count("results"), count("results_history"), count("runs")) == (6, 2, 2)
    out = CliRunner().invoke(cli, ["run", "--engine", "fake", "--restart", str(job)])
    assert ("Note: running 6 stored rows again: --restart set 6 stored rows aside: each stays stored until its "
            "new result replaces it\n") in out.stderr
    # a limit the input does not reach (a cap kept in the job) cuts nothing: --restart is whole
    docs = tmp_path / "data" / "docs.parquet"
    pq.write_table(pq.read_table(docs).slice(0, 4), docs)
    out = CliRunner().invoke(cli, ["run", "--engine", "fake", "--restart", "--limit", "100", str(job)])
    assert ("Note: running 4 stored rows again: --restart set 4 stored rows aside: each stays stored until its "
            "new result replaces it; 2 not in this run's input moved to results_history\n") in out.stderr
    assert count("results") == 4


def test_a_second_job_file_with_the_same_name_and_database_is_named(make_job, tmp_path):
    """Two job files, one `name:`, one database, that make rows differently: each redoes the other's
    rows, so the run says so. An identical copy, the same file again, a copy renamed apart, or a job
    file moved away, says nothing."""
    import yaml
    from click.testing import CliRunner

    from runner.cli import cli

    job = make_job(rows=4)
    copy = tmp_path / "copy.yaml"
    spec = yaml.safe_load(job.read_text())
    copy.write_text(yaml.safe_dump(spec))
    run = lambda path: CliRunner().invoke(cli, ["run", "--engine", "fake", str(path)])  # noqa: E731
    assert "another job file" not in run(job).stderr
    assert "another job file" not in run(job).stderr
    assert "another job file" not in run(copy).stderr  # an identical copy: the same rows, nothing redone
    assert "another job file" not in run(job).stderr
    copy.write_text(yaml.safe_dump(spec | {"sampling": spec["sampling"] | {"max_tokens": 48}}))
    out = run(copy)
    assert out.exit_code == 0
    assert (f"Note: job t in {tmp_path / 'out' / 'results.sqlite'} was last run from another job file, {job}, which "
            "makes its rows differently: the two share its stored rows by id, each redoing the other's; give one of "
            "them another `name:` to keep their results apart") in out.stderr
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    notes = json.loads(con.execute("SELECT engine_choice_json FROM run_stats ORDER BY run_id DESC").fetchone()[0])["notes"]
    assert any("another job file" in n for n in notes)
    copy.write_text(yaml.safe_dump(spec | {"name": "t2", "sampling": spec["sampling"] | {"max_tokens": 48}}))
    assert "another job file" not in run(job).stderr  # renamed apart, as the note advised
    copy.write_text(yaml.safe_dump(spec | {"sampling": spec["sampling"] | {"max_tokens": 48}}))
    assert "another job file" in run(copy).stderr  # the other way round
    moved = tmp_path / "moved.yaml"
    copy.rename(moved)
    assert "another job file" not in run(job).stderr  # the file it ran from is gone: moved, not shared


def test_rows_a_restart_set_aside_are_not_done_nor_training_data(make_job):
    """Rows --restart marked to be run again are stored (and exported) but not taken as done by the
    done filter, nor as ok outputs by distill (ok_results), until their new result replaces them."""
    import sqlite3

    from runner.store import Store

    job = load_job(make_job(rows=4))
    first = run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema))
    con = sqlite3.connect(job.database_path)
    con.execute("UPDATE results SET set_aside_at_utc = '2026-01-01' WHERE row_id IN ('r001', 'r002')")
    con.commit()
    store = Store(job.database_path)
    fp = con.execute("SELECT fingerprint FROM results LIMIT 1").fetchone()[0]
    assert [r[0] for r in store.ok_results(job.name, fp)] == ["r000", "r003"]
    assert store.done_row_ids(job.name, fp) == {"r000", "r003"}
    again = run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema))
    assert again.stats["rows_total"] == 2 and again.rows_redone == 2 and first.run_id != again.run_id
    assert con.execute("SELECT count(*) FROM results WHERE set_aside_at_utc IS NOT NULL").fetchone() == (0,)
    assert con.execute("SELECT row_id, set_aside_at_utc, replaced_by_run_id FROM results_history ORDER BY row_id").fetchall() \
        == [("r001", "2026-01-01", again.run_id), ("r002", "2026-01-01", again.run_id)]
