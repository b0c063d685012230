"""A small real-text GPT corpus assembled at run time from the Python standard library.

:func:`build_default_corpus` needs no download and no data file: it collects the docstrings of a
fixed, sorted list of standard-library modules (:data:`STDLIB_MODULES`): for each module its own
docstring and those of its top-level classes, functions and methods, each distinct docstring once.
They are read from the module's source file with ``ast`` (only parent packages get imported, and
monkeypatching by other libraries cannot change them); modules without Python source (``builtins``,
``math``, ...) are imported and their live docstrings used. That is about 1.2 MB of English
technical prose on CPython 3.11. Each module is one document. The text is written as JSONL,
tokenized with the byte-level tokenizer and indexed with
:func:`megatron_npu.data.preprocess.preprocess`.

The result is deterministic for a given Python build (the docstrings are static text); a module
that a build lacks (e.g. ``sqlite3``) is left out. Outputs are named by the SHA-256 of the corpus
text, so a second call finds them and returns without tokenizing again.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import warnings

from megatron_npu.files import write_private

__all__ = [
    "CORPUS_VERSION",
    "STDLIB_MODULES",
    "build_default_corpus",
    "default_corpus_documents",
    "default_corpus_sha256",
]

#: Bump when the way the corpus is assembled changes (it is part of the cache key).
CORPUS_VERSION = 1

#: Standard-library modules whose docstrings form the corpus (all safe to import).
STDLIB_MODULES: tuple[str, ...] = tuple(
    sorted(
        """
abc argparse ast asyncio asyncio.base_events asyncio.events asyncio.futures asyncio.locks
asyncio.queues asyncio.streams asyncio.subprocess asyncio.tasks base64 bdb binascii bisect
builtins bz2 calendar cmath cmd code codecs codeop collections collections.abc colorsys
concurrent.futures concurrent.futures._base concurrent.futures.process concurrent.futures.thread
configparser contextlib contextvars copy copyreg csv dataclasses datetime decimal difflib dis
doctest email email.charset email.feedparser email.generator email.header email.headerregistry
email.message email.parser email.policy email.utils enum errno faulthandler filecmp fileinput
fnmatch fractions ftplib functools gc getopt getpass gettext glob graphlib gzip hashlib heapq
hmac html html.parser http http.client http.cookiejar http.cookies http.server imaplib importlib
importlib.abc importlib.machinery importlib.resources importlib.util inspect io ipaddress
itertools json json.decoder json.encoder keyword linecache locale logging logging.config
logging.handlers lzma mailbox marshal math mimetypes multiprocessing multiprocessing.connection
multiprocessing.context multiprocessing.managers multiprocessing.pool multiprocessing.process
multiprocessing.queues multiprocessing.shared_memory multiprocessing.synchronize netrc numbers
operator optparse os os.path pathlib pdb pickle pickletools pkgutil platform plistlib poplib
posixpath pprint profile pstats py_compile pyclbr pydoc queue quopri random re reprlib
rlcompleter runpy sched secrets select selectors shelve shlex shutil signal site smtplib socket
socketserver sqlite3 ssl stat statistics string stringprep struct subprocess symtable sys
sysconfig tabnanny tarfile tempfile textwrap threading time timeit token tokenize trace
traceback tracemalloc types typing unicodedata unittest unittest.case unittest.loader
unittest.main unittest.mock unittest.result unittest.runner unittest.suite urllib urllib.error
urllib.parse urllib.request urllib.response urllib.robotparser uuid warnings wave weakref
webbrowser wsgiref.handlers wsgiref.simple_server wsgiref.util wsgiref.validate xml.dom
xml.dom.minidom xml.dom.pulldom xml.etree.ElementTree xml.parsers.expat xml.sax xml.sax.handler
xml.sax.saxutils xml.sax.xmlreader xmlrpc.client xmlrpc.server zipapp zipfile zipimport zlib
zoneinfo
""".split()
    )
)

_MIN_DOC_CHARS = 40
_PREFIX_STEM = "stdlib_docs"


def _add(parts: list[str], seen: set[str], title: str, doc: str | None) -> None:
    if doc and len(doc) >= _MIN_DOC_CHARS and doc not in seen:
        seen.add(doc)
        parts.append(f"{title}\n\n{doc}")


def _source_document(name: str, source: str, seen: set[str]) -> str:
    """Docstrings read from the module's source with ``ast``: immune to run-time monkeypatching
    of the module (which other libraries do, e.g. to ``inspect`` and ``typing`` functions)."""
    parts: list[str] = []
    tree = ast.parse(source)
    _add(parts, seen, name, ast.get_docstring(tree))
    definitions = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if not isinstance(node, definitions):
            continue
        _add(parts, seen, f"{name}.{node.name}", ast.get_docstring(node))
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, definitions):
                    title = f"{name}.{node.name}.{member.name}"
                    _add(parts, seen, title, ast.get_docstring(member))
    return "\n\n".join(parts)


def _live_doc(obj: object) -> str | None:
    doc = getattr(obj, "__doc__", None) if obj is not None else None
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc else None


def _live_document(name: str, module: object, seen: set[str]) -> str:
    """Docstrings of a module without Python source (``builtins``, ``math``, ...)."""
    parts: list[str] = []
    owners = (name, "_" + name)
    _add(parts, seen, name, _live_doc(module))
    namespace = vars(module)
    for attr in sorted(namespace):
        obj = namespace[attr]
        if inspect.ismodule(obj) or getattr(obj, "__module__", None) not in owners:
            continue
        if inspect.isclass(obj):
            _add(parts, seen, f"{name}.{attr}", _live_doc(obj))
            members = vars(obj)
            for member_name in sorted(members):
                member = members[member_name]
                if inspect.isroutine(member) or inspect.isdatadescriptor(member):
                    _add(parts, seen, f"{name}.{attr}.{member_name}", _live_doc(member))
        elif inspect.isroutine(obj):
            _add(parts, seen, f"{name}.{attr}", _live_doc(obj))
    return "\n\n".join(parts)


def _module_document(name: str, seen: set[str]) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin or ""
    if origin.endswith(".py") and os.path.isfile(origin):
        with open(origin, encoding="utf-8") as handle:
            return _source_document(name, handle.read(), seen)
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return _live_document(name, module, seen)


@functools.lru_cache(maxsize=1)
def default_corpus_documents() -> tuple[tuple[str, str], ...]:
    """``(module name, document text)`` for every module in :data:`STDLIB_MODULES` that this
    Python has, in sorted order (computed once per process)."""
    documents = []
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            text = _module_document(name, seen)
            if text:
                documents.append((name, text))
    return tuple(documents)


def _jsonl(documents: tuple[tuple[str, str], ...]) -> bytes:
    lines = (
        json.dumps({"id": name, "text": text}, ensure_ascii=False, sort_keys=True)
        for name, text in documents
    )
    return ("\n".join(lines) + "\n").encode("utf-8")


def default_corpus_sha256() -> str:
    """SHA-256 identifying the corpus (its JSONL bytes, corpus version and tokenizer)."""
    digest = hashlib.sha256(f"megatron-npu-corpus-v{CORPUS_VERSION}:ByteLevel\n".encode())
    digest.update(_jsonl(default_corpus_documents()))
    return digest.hexdigest()


def build_default_corpus(out_dir: str | os.PathLike) -> str:
    """Build (or find) the stdlib-docstring corpus under ``out_dir``; return its dataset prefix.

    Writes ``stdlib_docs_<hash16>.jsonl`` and ``stdlib_docs_<hash16>_text_document.{bin,idx}``
    (byte-level tokens, EOD-terminated documents; files 0640, created directories 0750). When both
    index files already exist the call returns at once. Safe to call from several processes at
    the same time: every file is written under a unique temporary name and renamed into place.
    """
    from megatron_npu.data.preprocess import preprocess
    from megatron_npu.data.tokenizers import ByteLevelTokenizer

    out_dir = os.path.abspath(os.fspath(out_dir))
    digest = default_corpus_sha256()
    output_prefix = os.path.join(out_dir, f"{_PREFIX_STEM}_{digest[:16]}")
    prefix = f"{output_prefix}_text_document"
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return prefix

    jsonl_path = output_prefix + ".jsonl"
    if not os.path.isfile(jsonl_path):
        write_private(jsonl_path, _jsonl(default_corpus_documents()))
    summary = preprocess([jsonl_path], output_prefix, ByteLevelTokenizer(), json_key="text")
    assert summary["prefix"] == prefix, (summary["prefix"], prefix)
    return prefix
