"""The long-document books from the Hugging Face Hub (data.books.source hf), offline.

``datasets.load_dataset`` is replaced by a stand-in that streams rows shaped like those of
manu/project_gutenberg (string ``id`` = ebook number, ``text`` = the raw ebook) and records how far it
was read. The mirror's books (../shared/data/gutenberg) are the reference: a Hub row carrying a mirror
book with a Project Gutenberg header and licence around it must read back as the mirror's book.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from hybrid_llama import books as B
from hybrid_llama.books_hub import find_books, write_books
from hybrid_llama.config import SCHEMA_PATH, ConfigError
from hybrid_llama.files import sha256_of
from hybrid_llama.pipeline import Pipeline, path, shared_data_dir
from hybrid_llama.sources import DataError

REPO = Path(__file__).resolve().parents[1]
MIRROR = shared_data_dir() / "gutenberg"
needs_books = pytest.mark.skipif(not MIRROR.is_dir(), reason=f"no books at {MIRROR}")

HUB = {"kind": "hf", "path": "manu/project_gutenberg", "name": None, "split": "en", "revision": None,
       "id_column": "id", "text_column": "text"}
LABEL = "hf:manu/project_gutenberg:en"


class FakeHub:
    """``datasets.load_dataset`` for a streamed split: yields ``rows`` in order, records the calls and
    how many rows were taken; taking a row past ``stop_after`` fails the test (the stream must stop)."""

    def __init__(self, rows: list[dict], stop_after: int | None = None) -> None:
        self.rows, self.stop_after = rows, stop_after
        self.calls: list[tuple[tuple, dict]] = []
        self.taken = 0

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self._stream()

    def _stream(self):
        for row in self.rows:
            if self.stop_after is not None and self.taken >= self.stop_after:
                pytest.fail(f"read row {self.taken + 1} although every book was found by row {self.stop_after}")
            self.taken += 1
            yield dict(row)


@pytest.fixture
def hub(monkeypatch):
    import datasets

    def install(rows: list[dict], stop_after: int | None = None) -> FakeHub:
        fake = FakeHub(rows, stop_after)
        monkeypatch.setattr(datasets, "load_dataset", fake)
        return fake

    return install


def gutenberg_ebook(number: str, title: str, body: str) -> str:
    """``body`` as Project Gutenberg serves it: header with the START marker, licence after the END
    marker, CRLF line ends."""
    head = (f"The Project Gutenberg eBook of {title}\r\n\r\nThis ebook is for the use of anyone anywhere.\r\n\r\n"
            f"Title: {title}\r\n\r\nRelease date: 1 May 1990 [eBook #{number}]\r\n\r\n"
            f"*** START OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\r\n")
    tail = (f"\r\n*** END OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\r\n\r\n"
            "Updated editions will replace the previous one.\r\nSection 1. General Terms of Use\r\n")
    return head + body + tail


def mirror_text(name: str) -> str:
    return (MIRROR / f"{name}.txt").read_bytes().decode("utf-8", errors="replace")  # CRLF kept


# ----------------------------------------------------------------------------- names and ids


def test_book_names_map_to_gutenberg_ids():
    assert [B.gutenberg_id(n) for n in ("pg11", "pg1342", "pg5200")] == ["11", "1342", "5200"]
    for bad in ("pg", "pg0", "pg012", "PG12", "pg12a", "1342", "moby_dick"):
        with pytest.raises(ValueError, match="not a Project Gutenberg book name"):
            B.gutenberg_id(bad)


# ----------------------------------------------------------------------------- streaming


def test_stream_stops_once_every_book_is_found(hub):
    rows = [
        {"id": "1", "text": "The Declaration of Independence"},
        {"id": "5200", "text": "Metamorphosis, first row"},
        {"id": "52000", "text": "another book whose id starts alike"},
        {"id": "5200", "text": "Metamorphosis, a later row"},
        {"id": 174, "text": "Dorian Gray"},  # an integer id reads as its number
        {"id": "1342", "text": "never reached"},
    ]
    fake = hub(rows, stop_after=5)
    found = find_books(HUB, {"pg5200": "5200", "pg174": "174"})
    assert fake.taken == 5
    assert fake.calls == [(("manu/project_gutenberg", None), {"split": "en", "streaming": True, "revision": None})]
    assert {n: (b.id, b.text, b.origin) for n, b in found.items()} == {
        "pg5200": ("5200", "Metamorphosis, first row", f"{LABEL}: row 2"),  # the first row of an id wins
        "pg174": ("174", "Dorian Gray", f"{LABEL}: row 5"),
    }


def test_revision_and_columns_come_from_the_source(hub):
    fake = hub([{"ebook": "11", "content": "Alice"}, {"ebook": "16", "content": "Peter Pan"}])
    source = {**HUB, "revision": "a1b2c3", "id_column": "ebook", "text_column": "content"}
    found = find_books(source, {"pg16": "16"})
    assert found["pg16"].text == "Peter Pan" and fake.calls[0][1]["revision"] == "a1b2c3"


def test_missing_books_are_named_after_the_whole_split(hub):
    rows = [{"id": "11", "text": "Alice"}, {"id": "16", "text": "Peter Pan"}, {"id": "174", "text": "Dorian Gray"}]
    fake = hub(rows)
    with pytest.raises(DataError) as err:
        find_books(HUB, {"pg11": "11", "pg98": "98", "pg2701": "2701"})
    assert str(err.value) == (f"{LABEL}: no row has id '98', '2701' (books ['pg2701', 'pg98']) in all 3 rows")
    assert fake.taken == 3


def test_rows_without_the_id_or_text_column_are_data_errors(hub):
    hub([{"text": "no id here"}])
    with pytest.raises(DataError, match=rf"{LABEL}: row 1: missing column 'id' \(have \['text'\]\)"):
        find_books(HUB, {"pg11": "11"})
    hub([{"id": "11", "body": "Alice"}])
    with pytest.raises(DataError, match=rf"{LABEL}: row 1: missing column 'text'"):
        find_books(HUB, {"pg11": "11"})


# ----------------------------------------------------------------------------- the files the book jobs read


@needs_books
def test_hub_books_read_as_the_mirror_books(hub, tmp_path):
    """Every mirror book, served by the stand-in Hub with a Gutenberg header and licence around it
    (other books before, between and after), is written verbatim and reads back as the mirror's book;
    the held-out split of the written directory is the mirror's."""
    names = B.book_names(MIRROR)
    assert len(names) == 8
    rows = [{"id": "2", "text": gutenberg_ebook("2", "Other Book", "Not one of ours.\r\n")}]
    for name in names:
        number = B.gutenberg_id(name)
        rows += [{"id": number, "text": gutenberg_ebook(number, f"Book {number}", mirror_text(name))},
                 {"id": f"9{number}", "text": "a book between"}]
    hub(rows + [{"id": "3", "text": "after"}], stop_after=len(rows) - 1)

    found = find_books(HUB, {name: B.gutenberg_id(name) for name in names})
    manifest = write_books(found, tmp_path)

    assert B.book_names(tmp_path) == names
    for name in names:
        written = (tmp_path / f"{name}.txt").read_bytes()
        assert written == found[name].text.encode("utf-8")  # verbatim: header, licence and CRLF kept
        assert b"*** START OF THE PROJECT GUTENBERG EBOOK" in written
        assert manifest[name] == {"id": B.gutenberg_id(name), "row": found[name].origin,
                                  "sha256": sha256_of(tmp_path / f"{name}.txt")}
    assert B.read_books(tmp_path, names) == B.read_books(MIRROR, names)
    heldout = ["pg174", "pg1342"]
    assert B.heldout_books(tmp_path, heldout) == B.heldout_books(MIRROR, heldout)
    assert B.training_books(tmp_path, heldout) == B.training_books(MIRROR, heldout)


def _run_books_download(tmp_path: Path, rows: list[dict], books: dict[str, str]) -> subprocess.CompletedProcess:
    """workflow/scripts/books_download.py with a stand-in ``snakemake`` object, as Snakemake's
    ``script:`` runs it, and ``datasets.load_dataset`` streaming ``rows``."""
    rows_file = tmp_path / "rows.json"
    rows_file.write_text(json.dumps(rows))
    sm = {"output": {"books": [path("book", book=n) for n in books], "manifest": path("books_manifest")},
          "params": {"source": HUB, "books": books}, "log": [str(tmp_path / "books_download.log")],
          "rule": "books_download"}
    driver = textwrap.dedent(
        f"""
        import json, runpy, sys, types
        import datasets
        sys.path.insert(0, {str(REPO / "workflow" / "scripts")!r})
        rows = json.load(open({str(rows_file)!r}))
        datasets.load_dataset = lambda *args, **kwargs: iter(rows)
        sm = {sm!r}
        snakemake = types.SimpleNamespace(
            output=types.SimpleNamespace(**sm["output"]), params=types.SimpleNamespace(**sm["params"]),
            log=sm["log"], rule=sm["rule"], wildcards={{}}, threads=1)
        runpy.run_path({str(REPO / "workflow" / "scripts" / "books_download.py")!r},
                       init_globals={{"snakemake": snakemake}}, run_name="__main__")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_books_download_script_writes_the_mirror_layout(tmp_path):
    """Rule books_download's script: one <name>.txt per book and a manifest; a book of an earlier list
    is removed (the readers take the directory's *.txt as its books); a missing id fails the job."""
    directory = tmp_path / "resources" / "data" / "books"
    directory.mkdir(parents=True)
    (directory / "pg84.txt").write_text("Frankenstein, from an earlier names list")
    rows = [{"id": "84", "text": "Frankenstein"}, {"id": "11", "text": gutenberg_ebook("11", "Alice", "Alice\r\n")},
            {"id": "5200", "text": gutenberg_ebook("5200", "Metamorphosis", "Gregor\r\n")}]
    books = {"pg11": "11", "pg5200": "5200"}
    proc = _run_books_download(tmp_path, rows, books)
    log = (tmp_path / "books_download.log").read_text()
    assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]
    assert B.book_names(directory) == ["pg11", "pg5200"]
    assert (directory / "pg11.txt").read_bytes() == rows[1]["text"].encode()
    assert B.read_books(directory, ["pg11", "pg5200"]) == ["Alice", "Gregor"]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["source"] == HUB
    assert manifest["books"] == {
        "pg11": {"id": "11", "row": f"{LABEL}: row 2", "sha256": sha256_of(directory / "pg11.txt")},
        "pg5200": {"id": "5200", "row": f"{LABEL}: row 3", "sha256": sha256_of(directory / "pg5200.txt")},
    }

    proc = _run_books_download(tmp_path, rows, {"pg11": "11", "pg98": "98"})
    log = (tmp_path / "books_download.log").read_text()
    assert proc.returncode != 0
    assert f"{LABEL}: no row has id '98' (books ['pg98']) in all 3 rows" in log + proc.stderr


# ----------------------------------------------------------------------------- the workflow's view


def _pipeline(cfg: dict) -> Pipeline:
    cfg = copy.deepcopy(cfg)
    validate(cfg, str(SCHEMA_PATH))
    return Pipeline(cfg, REPO)


def _auto_config(shared: Path, **books) -> dict:
    """config/test.yaml with every data set on 'auto' and the mirror at ``shared``."""
    cfg = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    cfg["shared_data"] = str(shared)
    for name in ("transfer", "instruct", "mmlu", "books"):
        cfg["data"][name]["source"] = "auto"
    cfg["data"]["books"].update(books)
    return cfg


@needs_books
def test_auto_takes_the_mirror_when_it_has_the_books(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the checks look for resources/weights/* relative to the working dir
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "gutenberg").symlink_to(MIRROR)
    p = _pipeline(_auto_config(tmp_path / "shared"))
    p.check()
    assert p.data_kind("books") == "local"
    books = tmp_path / "shared" / "gutenberg"
    assert p.books_source() == {"dir": str(books), "heldout": ["pg5200"]}
    assert p.book_files() == [str(books / "pg5200.txt")]


def test_auto_takes_the_hub_without_the_mirror(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared").mkdir()  # a mirror without the books
    p = _pipeline(_auto_config(tmp_path / "shared"))
    p.check()  # no books directory to check: rule books_download writes it
    assert p.data_kind("books") == "hf"
    assert p.books_source() == {"dir": "resources/data/books", "heldout": ["pg5200"]}
    assert p.book_files() == ["resources/data/books/pg5200.txt"] == [path("book", book="pg5200")]
    names = ["pg11", "pg16", "pg98", "pg174", "pg236", "pg1342", "pg2701", "pg5200"]
    assert p.hub_book_files() == [f"resources/data/books/{n}.txt" for n in names]
    assert p.hub_books() == {n: n.removeprefix("pg") for n in names}
    assert p.books_hub_source() == HUB  # the schema's defaults
    # the same config with the Hub named explicitly, and with the mirror named explicitly
    assert _pipeline(_auto_config(tmp_path / "shared", source="hf")).books_source() == p.books_source()
    with pytest.raises(ConfigError) as err:
        _pipeline(_auto_config(tmp_path / "shared", source="local")).check()
    assert err.value.key == "data.books.local"
