"""`runner distill`'s training pairs: each stored output with the prompt the run sent for it."""
from __future__ import annotations

import json
import sqlite3

import pyarrow as pa
import pyarrow.parquet as pq

from runner.distill import examples
from runner.engines.fake import FakeEngine
from runner.prompting import builder_for
from runner.run import run_job
from runner.spec import load_job
from runner.store import Store
from tests.conftest import SCHEMA, write_docs


def test_a_cut_document_is_paired_with_the_cut_prompt_the_model_saw(make_job, tmp_path):
    docs = write_docs(tmp_path / "data" / "long.parquet", 3)
    t = pq.read_table(docs).to_pydict()
    t["text"][1] = "word " * 3000  # longer than max_model_len: on_too_long: truncate cuts it
    pq.write_table(pa.table(t), docs)
    job = load_job(make_job(docs=docs, job={"input": {"on_too_long": "truncate"}}))
    seen = FakeEngine(SCHEMA)
    run_job(job, engine_factory=lambda j: seen)
    sent = {r.row_id: r.prompt_token_ids for r in seen.seen}
    con = sqlite3.connect(job.database_path)
    with con:  # the fake engine stores no token ids; distill trains on them
        con.execute("UPDATE results SET output_token_ids_json = ?", (json.dumps([5, 6, 7]),))
    con.close()

    store = Store(job.database_path)
    try:
        pairs = {e.row_id: e for e in examples(job, store, builder_for(job), None)}
    finally:
        store.close()
    assert sorted(pairs) == sorted(sent) == ["r000", "r001", "r002"]
    for row_id, e in pairs.items():
        assert e.prompt == sent[row_id]
        assert e.output[:3] == [5, 6, 7]
    assert len(pairs["r001"].prompt) + job.spec.sampling.max_tokens <= job.engine.max_model_len
