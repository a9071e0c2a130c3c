"""What the speculative-decoding commands store: calibrations (`speculative: auto`),
verifications (`runner verify`) and drafts (`runner distill`). A part of Store."""
from __future__ import annotations

import json
from typing import Optional

from sqlalchemy import select

from runner.migrations import utc_now


class SpeculationRecords:
    """Store's methods for the calibrations, verifications and drafts tables."""

    # -- calibrations -----------------------------------------------------------------------
    def latest_calibration(self, key_sha256: str) -> Optional[dict]:
        """The newest stored calibration for this key, or None."""
        q = select(self.calibrations).where(self.calibrations.c.key_sha256 == key_sha256) \
            .order_by(self.calibrations.c.id.desc()).limit(1)
        with self.engine.connect() as conn:
            row = conn.execute(q).mappings().first()
            return dict(row) if row else None

    def save_calibration(self, *, key: dict, key_sha256: str, job_name: str, run_id: Optional[int],
                         chosen_draft_tokens: int, speculative: Optional[dict], kv_total_blocks: Optional[int],
                         engine_start_s: Optional[float], record: dict) -> int:
        values = dict(key_sha256=key_sha256, key_json=json.dumps(key, sort_keys=True), job_name=job_name,
                      run_id=run_id, chosen_draft_tokens=chosen_draft_tokens,
                      speculative_json=json.dumps(speculative, sort_keys=True) if speculative else None,
                      kv_total_blocks=kv_total_blocks, engine_start_s=engine_start_s,
                      record_json=json.dumps(record, sort_keys=True, default=str), created_at_utc=utc_now())
        with self._tx() as conn:
            return conn.execute(self.calibrations.insert().values(**values)).inserted_primary_key[0]

    # -- verifications and drafts -------------------------------------------------------------
    def save_verification(self, *, key_sha256: str, setting: dict, job_name: str, rows: int, agreement: float,
                          field_agreement: dict, differences: list, settings_sha256: Optional[str] = None,
                          baseline_agreement: Optional[float] = None,
                          rows_changed_by_drafts_only: Optional[int] = None,
                          rows_changed_by_engine_only: Optional[int] = None) -> int:
        values = dict(key_sha256=key_sha256, setting_json=json.dumps(setting, sort_keys=True), job_name=job_name,
                      rows=rows, agreement=agreement, field_agreement_json=json.dumps(field_agreement, sort_keys=True),
                      differences_json=json.dumps(differences, ensure_ascii=False), created_at_utc=utc_now(),
                      settings_sha256=settings_sha256, baseline_agreement=baseline_agreement,
                      rows_changed_by_drafts_only=rows_changed_by_drafts_only,
                      rows_changed_by_engine_only=rows_changed_by_engine_only)
        with self._tx() as conn:
            return conn.execute(self.verifications.insert().values(**values)).inserted_primary_key[0]

    def verifications_of(self, job_name: str, key_sha256s: list[str], setting: Optional[dict],
                         most: int = 1000) -> list[dict]:
        """The job's verifications of `setting` stored under any of the keys, newest first."""
        if setting is None:
            return []
        v = self.verifications.c
        q = select(self.verifications).where(v.job_name == job_name, v.key_sha256.in_(key_sha256s),
                                             v.setting_json == json.dumps(setting, sort_keys=True)).order_by(v.id.desc()).limit(most)
        with self.engine.connect() as conn:
            return [dict(row) for row in conn.execute(q).mappings()]

    def save_draft(self, **values) -> int:
        values = values | {"train_json": json.dumps(values["train_json"], sort_keys=True), "created_at_utc": utc_now()}
        with self._tx() as conn:
            return conn.execute(self.drafts.insert().values(**values)).inserted_primary_key[0]

    def latest_draft(self, job_name: str) -> Optional[dict]:
        d = self.drafts.c
        with self.engine.connect() as conn:
            row = conn.execute(select(self.drafts).where(d.job_name == job_name).order_by(d.id.desc()).limit(1)).mappings().first()
            return dict(row) if row else None
