"""Where a job's rows come from: the reader seam.

A Reader gives Arrow record batches of the job's columns (InputSpec.columns), honouring the row
limit; runner/inputs.py checks them (scan) and turns them into Documents. LocalReader reads a
file, a folder or a glob (hive partitions `key=value/` become columns) of Parquet, JSON Lines,
CSV, or OpenAI batch files (vLLM run_batch's input: custom_id and body.messages). Parquet is read
a row group at a time: bounded memory (pyarrow's whole-file iterator kept 130 MB more at a
million rows, and its dataset scanner 80 MB more); JSON Lines and CSV stream through
pyarrow.dataset. RayDataReader reads through Ray Data for the `ray` executor.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

from runner import json_lines
from runner.blocks import Resumable
from runner.input_paths import file_format, input_files, partition_root
from runner.csv_quotes import explain_csv_error, refuse_open_quote
from runner.errors import InputError
from runner.spec import InputSpec


def _refuse_open_quote_if_readable(file: str) -> None:
    """refuse_open_quote's InputError, where the file can be read to its end at all."""
    try:
        refuse_open_quote(file)
    except InputError:
        raise
    except Exception:  # noqa: BLE001 - the error pyarrow gave is the one to report then
        pass


def _is_parquet(file: str) -> bool:
    """Whether the file begins as Parquet does (PAR1)."""
    try:
        with open(file, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


class Reader:
    """Record batches (file, batch) of the job's columns, in a deterministic order."""

    def __init__(self, input_path: str, spec: InputSpec):
        self.input_path, self.spec = input_path, spec
        self._scanning = False  # checks that read a file twice run in the scan only
        self.cut_by_limit = False  # set where input.limit stopped a reading before the input's end

    def files(self) -> list[str]:
        return input_files(self.input_path, self.spec.format)

    def batches(self, columns: Optional[list[str]] = None) -> Iterator[tuple[str, object]]:
        raise NotImplementedError

    def scan(self, keep_ids: bool = False):
        """Check every row once (runner/inputs.py): an InputScan, or an InputError."""
        from runner.inputs import scan_input

        self._scanning, self.cut_by_limit = True, False
        try:
            scan = scan_input(self, keep_ids=keep_ids)
        finally:
            self._scanning = False
        scan.cut_by_limit = self.cut_by_limit
        return scan

    def documents(self, system_prompt, skip: set[int] | frozenset[int] = frozenset()):
        """The rows as Documents, a record batch at a time, without the row numbers in `skip`."""
        from runner.inputs import read_documents

        return read_documents(self, system_prompt, skip)


class LocalReader(Reader):
    """Files read in this process (pyarrow)."""

    def batches(self, columns: Optional[list[str]] = None) -> Iterator[tuple[str, object]]:
        import pyarrow as pa

        columns = columns or self.spec.column_names()
        left = self.spec.limit
        for file, partition in self._fragments():
            try:
                for batch in self._file_batches(file, partition, columns):
                    if left is not None:
                        if left < batch.num_rows:
                            self.cut_by_limit = True  # rows past the limit: the input goes on
                        if left <= 0:
                            return
                        batch = batch.slice(0, left)
                        left -= batch.num_rows
                    yield file, _with_partition(file, batch, partition, columns)
            except (OSError, pa.ArrowException) as exc:
                fmt = file_format(file, self.spec.format)
                if fmt != "parquet" and _is_parquet(file):  # input.format names another format than the file's
                    raise InputError(f"{file}: a Parquet file, read as {fmt} (input.format: {fmt})") from None
                if fmt == "csv":  # a quote left open swallows the rows after it: say that, not their count
                    _refuse_open_quote_if_readable(file)
                    raise InputError(explain_csv_error(file, str(exc))) from None
                raise InputError(f"{file}: corrupt or unreadable {fmt} data ({exc})") from None

    def _file_batches(self, file: str, partition: dict, columns: list[str]):
        fmt = file_format(file, self.spec.format)
        if fmt == "parquet":
            pf = self._open(file, columns)
            names = set(pf.schema_arrow.names)
            self._check_columns(file, names, partition)
            present = _own_columns(columns, partition, names)
            for rg in range(pf.num_row_groups):
                yield from pf.iter_batches(batch_size=self.spec.batch_rows, row_groups=[rg], columns=present)
        elif fmt == "openai-batch":
            from runner.openai_batch import batches

            first = True
            for batch in batches(file, self.spec.batch_rows):
                if first:
                    self._check_columns(file, set(batch.schema.names), partition)
                    first = False
                yield batch.select([c for c in columns if c not in partition])
        else:
            yield from self._dataset_batches(file, fmt, partition, columns)

    def _dataset_batches(self, file: str, fmt: str, partition: dict, columns: list[str]):
        """JSON Lines (json_lines.py) or CSV (pyarrow.dataset), a batch at a time."""
        import pyarrow.dataset as ds

        fields = dict(self.spec.columns())
        try:
            if fmt == "jsonl":
                present = _own_columns(columns, partition, json_lines.first_keys(file) if partition else set())
                yield from json_lines.batches(file, [(c, fields[c]) for c in present], self.spec.batch_rows,
                                              lambda keys: self._check_columns(file, keys, partition))
                return

            def read(block: int):  # CSV in blocks of this size (Resumable grows them for a long row)
                data = ds.dataset(file, format=ds.CsvFileFormat(**csv_options(self.spec, block)))
                names = set(data.schema.names)
                self._check_columns(file, names, partition)
                present = _own_columns(columns, partition, names)
                return data.to_batches(columns=present, batch_size=self.spec.batch_rows)

            if _blank(file):  # no header, no rows: an empty file, as an empty JSON Lines file is
                return
            yield from Resumable().batches(read, self.spec.batch_rows)
            if self._scanning:  # read to its end (a limit reached stops before): checked once, by the scan
                refuse_open_quote(file)
        except PermissionError:
            raise InputError(f"{file}: cannot read input (permission denied)") from None

    def _fragments(self) -> Iterator[tuple[str, dict]]:
        """(file, hive partition values) for each file, in path order: folders named `key=value`
        under the input folder or a glob's fixed part are columns of every row below them (Hive's
        convention, as pyarrow.dataset reads it: `__HIVE_DEFAULT_PARTITION__`, Spark's null, is null)."""
        from urllib.parse import unquote

        root = partition_root(self.input_path)
        for f in self.files():
            below = os.path.relpath(f, root) if root else ".."
            parts = Path(below).parts[:-1] if not below.startswith("..") else ()
            pairs = (unquote(p).split("=", 1) for p in parts if "=" in p)
            yield f, {k: None if v == HIVE_NULL else v for k, v in pairs}

    def _open(self, file: str, columns: list[str]):
        import pyarrow.parquet as pq

        # System prompts repeat on every row: read as a dictionary, decoded once a batch, not per row.
        dictionary = [self.spec.system_prompt_column] if self.spec.system_prompt_column in columns else None
        try:
            try:
                return pq.ParquetFile(file, read_dictionary=dictionary)
            except KeyError:  # no such column: opened plainly, _check_columns names it
                return pq.ParquetFile(file)
        except PermissionError:
            raise InputError(f"{file}: cannot read input (permission denied)") from None
        except OSError as exc:
            raise InputError(f"{file}: not a readable Parquet file ({exc})") from None
        except Exception as exc:  # pyarrow raises ArrowInvalid and others for corrupt files
            if self.spec.format == "parquet" and not _is_parquet(file) and not file.endswith(".parquet"):
                raise InputError(f"{file}: not a Parquet file, read as parquet (input.format: parquet)") from None
            raise InputError(f"{file}: corrupt Parquet file ({exc.__class__.__name__}: {exc})") from None

    def _check_columns(self, file: str, names: set[str], partition: dict) -> None:
        """The job's columns are in the file or its folders' names (hive partitions)."""
        for col, field in self.spec.columns():
            if col not in names and col not in partition:
                raise InputError(f"{file}: column {col!r} ({field}) not found; columns are "
                                 f"{sorted(names | set(partition))}")


def csv_options(spec: InputSpec, block_bytes: Optional[int] = None) -> dict:
    """CSV as documents need it, for pyarrow and Ray Data alike: quoted text may span lines, the
    job's text columns stay text (an id 007 is not the number 7), and an empty cell of them is null
    (so on_bad_row sees it); only an empty one: `NA`, `null` or `N/A` is text (Namibia's code, a
    word), not pyarrow's null."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    text = {c: pa.string() for c, _ in spec.columns()}
    blocks = {} if block_bytes is None else {"read_options": pcsv.ReadOptions(block_size=block_bytes)}
    return dict(parse_options=pcsv.ParseOptions(newlines_in_values=True),
                convert_options=pcsv.ConvertOptions(column_types=text, strings_can_be_null=True, null_values=[""]), **blocks)


def _own_columns(columns: list[str], partition: dict, names: set[str]) -> list[str]:
    """The job's columns to read from a file holding `names`: a column also in the folder's name is
    read too where the file has it, so that its values are checked against the folder's (_with_partition)."""
    return [c for c in columns if c not in partition or c in names]


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # the folder name Hive and Spark write for a null partition value


def _with_partition(file: str, batch, partition: dict, columns: list[str]):
    """The batch, with hive partition values added as constant text columns. Where the file has
    the column too (Parquet), its values must be the folder's: else one would replace the other."""
    if not partition:
        return batch
    import pyarrow as pa
    import pyarrow.compute as pc

    arrays = {name: batch.column(name) for name in batch.schema.names}
    for name, value in partition.items():
        if name not in columns:
            continue
        if name in arrays:
            own = pc.cast(arrays[name], pa.string())
            differ = pc.filter(own, pc.is_valid(own) if value is None else pc.not_equal(own, pa.scalar(value, pa.string())))
            if len(differ):
                raise InputError(f"{file}: column {name!r} holds {differ[0].as_py()!r} where its folder's name says "
                                 f"{name}={HIVE_NULL if value is None else value}: rename the column or the folder")
        arrays[name] = pa.array([value] * batch.num_rows, pa.string())
    return pa.record_batch([arrays[c] for c in columns], names=columns)


class RayDataReader(Reader):
    """The `ray` executor's reader: Ray Data reads Parquet and CSV files, in file order; JSON Lines
    are read as the local reader reads them."""

    def __init__(self, input_path: str, spec: InputSpec, job):
        super().__init__(input_path, spec)
        from runner.engines.ray_cluster import ensure_ray

        self.ray = ensure_ray(job)  # here, in the caller's thread: Ray must not start in the reader's thread

    def batches(self, columns: Optional[list[str]] = None) -> Iterator[tuple[str, object]]:
        ctx = self.ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # deterministic plans, same as the local reader
        files, columns = self.files(), columns or self.spec.column_names()
        formats = {file_format(f, self.spec.format) for f in files}
        if formats == {"jsonl"}:
            # Ray Data's read_json stops at a column whose type changes (ids 7 then "r8"; an integer
            # column meeting 2.5), which a local run reads as text (json_lines.py): read here, alike.
            return LocalReader(self.input_path, self.spec).batches(columns)
        if formats == {"parquet"}:
            ds = self.ray.data.read_parquet(files, columns=columns)
        elif formats == {"csv"}:
            files = [f for f in files if not _blank(f)]  # no header, no rows: as the local reader skips them
            if not files:
                return iter(())
            ds = self.ray.data.read_csv(files, **csv_options(self.spec)).select_columns(columns)
        else:
            raise InputError(f"{self.input_path}: the ray executor reads one of Parquet, JSON Lines or CSV at a time "
                             f"(found {', '.join(sorted(formats))}); run OpenAI batch files with executor: local")
        if self.spec.limit:
            ds = ds.limit(self.spec.limit)
        return ((self.input_path, b) for b in ds.iter_batches(batch_size=self.spec.batch_rows, batch_format="pyarrow"))


def make_reader(job) -> Reader:
    """The job's reader: Ray Data with `executor: ray`, else pyarrow in this process."""
    if job.spec.executor == "ray":
        return RayDataReader(job.input_path, job.spec.input, job)
    return LocalReader(job.input_path, job.spec.input)


def _blank(file: str) -> bool:
    """An input file with no header and no rows: 0 bytes, or nothing but a byte-order mark and line
    ends, compressed or not (what a tool writes when its export found nothing). Read until its
    first other byte: a file with rows stops at its first chunk."""
    if os.path.getsize(file) == 0:
        return True
    import pyarrow as pa

    try:
        with pa.input_stream(file, compression="detect") as stream:
            chunk = stream.read(1 << 16).removeprefix(b"\xef\xbb\xbf")
            while chunk:
                if chunk.strip(b"\r\n"):
                    return False
                chunk = stream.read(1 << 16)
    except Exception:  # not readable as its name says: the CSV reader names the problem
        return False
    return True
