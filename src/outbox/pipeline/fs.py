"""The archive's file operations, through Hadoop's FileSystem API in Spark's JVM.

One code path for every location Spark can write (a local directory, ``file://``,
``hdfs://``, ``s3a://`` with the connector on the classpath): listing, renaming,
deleting and small text files (the run manifests). The driver does these few
metadata operations; the executors write the Parquet files.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .common import fsync_path, local_path

log = logging.getLogger("outbox.pipeline.archive")

#: What ``fsync`` of a directory answers on a filesystem that cannot do it.
_NO_DIRECTORY_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}
#: What ``link`` answers on a filesystem without hard links (some FUSE and SMB mounts).
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
_warned: list[bool] = []  # said once a process


class ArchiveFS:
    def __init__(self, spark: Any, root: str) -> None:
        jvm = spark._jvm
        self._jvm = jvm
        self._Path = jvm.org.apache.hadoop.fs.Path
        self.root = root.rstrip("/")
        self.fs = self._Path(self.root).getFileSystem(spark._jsc.hadoopConfiguration())

    def uri(self, *parts: str) -> str:
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def _p(self, uri: str) -> Any:
        return self._Path(uri)

    def _base(self, uri: str) -> str:
        """``uri``'s path as its filesystem qualifies it, with a trailing slash: the prefix
        that ``list_files`` and ``relative`` cut off the paths under it."""
        return self.fs.makeQualified(self._p(uri)).toUri().getPath().rstrip("/") + "/"

    def exists(self, uri: str) -> bool:
        return bool(self.fs.exists(self._p(uri)))

    def length(self, uri: str) -> int:
        """The size in bytes of the file at ``uri``."""
        return int(self.fs.getFileStatus(self._p(uri)).getLen())

    def mkdirs(self, uri: str) -> None:
        path = local_path(uri)
        if path is not None:  # no process of Hadoop's per directory made (``_write_local``)
            os.makedirs(path, exist_ok=True)
            return
        self.fs.mkdirs(self._p(uri))

    def delete(self, uri: str, recursive: bool = True) -> None:
        if self.exists(uri):
            self.fs.delete(self._p(uri), recursive)

    def list_names(self, uri: str) -> list[str]:
        """Names directly under ``uri`` (empty when it does not exist)."""
        if not self.exists(uri):
            return []
        return sorted(status.getPath().getName() for status in self.fs.listStatus(self._p(uri)))

    def list_files(self, uri: str, *, prune: str | None = None) -> list[str]:
        """Paths of every file under ``uri``, relative to it, sorted; with ``prune``, the
        directories directly under ``uri`` whose names start with it are not looked into.
        Walked with ``listStatus``, a directory at a time: Hadoop's ``listFiles`` builds a
        ``LocatedFileStatus`` per file, whose permission the local filesystem reads by
        running ``ls -ld`` when Hadoop has no native library (PySpark's has none), a
        process per file listed (docs/pipeline.md, "Tests")."""
        if not self.exists(uri):
            return []
        base = self._base(uri)
        found: list[str] = []
        pending = [(self._p(uri), True)]
        while pending:
            directory, top = pending.pop()
            for status in self.fs.listStatus(directory):
                path = status.getPath()
                if status.isDirectory():
                    if not (top and prune is not None and str(path.getName()).startswith(prune)):
                        pending.append((path, False))
                    continue
                name = path.toUri().getPath()
                found.append(name[len(base):] if name.startswith(base) else name)
        return sorted(found)

    def relative(self, uri: str, files: Iterable[str]) -> list[str]:
        """``files``, URIs under ``uri`` as Spark names a read's input files, as paths
        relative to ``uri``, sorted: what ``list_files`` gives for them, with no listing
        (and no JVM call per file) of its own."""
        base = self._base(uri)
        paths = [unquote(urlsplit(f).path) for f in files]
        outside = [p for p in paths if not p.startswith(base)]
        if outside:
            raise ValueError(f"{outside[0]} is not under {uri}")
        return sorted(p[len(base):] for p in paths)

    def rename(self, src: str, dst: str) -> bool:
        parent, _, name = dst.rstrip("/").rpartition("/")
        if parent and name:
            self.mkdirs(parent)
        return bool(self.fs.rename(self._p(src), self._p(dst)))

    def write_text(self, uri: str, text: str) -> None:
        """Write a whole small file atomically where the filesystem allows: a hidden
        temporary file renamed into place (a single PUT on object stores)."""
        tmp = uri.rsplit("/", 1)
        tmp_uri = f"{tmp[0]}/.{tmp[1]}.tmp"
        path = local_path(uri)
        if path is not None:
            self._write_local(path, uri, text)
            return
        out = self.fs.create(self._p(tmp_uri), True)
        try:
            out.write(bytearray(text.encode("utf-8")))
        finally:
            out.close()
        self.sync([tmp_uri], directories=False)  # on disk before the rename makes it the file
        self.delete(uri, recursive=False)
        if not self.fs.rename(self._p(tmp_uri), self._p(uri)):
            raise OSError(f"could not rename {tmp_uri} to {uri}")
        self.sync([uri])  # and its name in its directory

    def _write_local(self, path: Path, uri: str, text: str) -> None:
        """``write_text`` on a local path, in Python: Hadoop's local filesystem, without its
        native library (PySpark ships none), runs ``chmod`` in a process of its own for
        every file it creates and its checksum file, and for every directory it makes
        (docs/pipeline.md, "Tests"). The same steps: a hidden temporary file, synced, then
        renamed into place (atomically here) and its name synced. The checksum file an
        earlier Hadoop write left beside the file goes first: Hadoop's reads verify the
        file against it when it is there."""
        tmp = path.with_name(f".{path.name}.tmp")
        os.makedirs(path.parent, exist_ok=True)  # as Hadoop's create makes the parents
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with open(fd, "wb") as out:
            out.write(text.encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
        path.with_name(f".{path.name}.crc").unlink(missing_ok=True)
        os.replace(tmp, path)
        self.sync([uri])

    def create_new(self, uri: str, text: str) -> bool:
        """Create a small file only if it is absent; False when it exists. The file appears
        with its whole text or not at all: the text is written to a temporary file first,
        which is then linked (a local or NFS path: ``link`` fails on an existing name) or
        renamed (HDFS: a rename onto an existing name fails) into place. A file created
        empty and then written was left empty by a kill between the two, and every later run
        refused it (found in review). On object stores Hadoop's rename is a check and a copy,
        so two writers at the same moment may both write (the later one's text stays)."""
        directory, name = uri.rsplit("/", 1)
        tmp_uri = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
        path, tmp = local_path(uri), local_path(tmp_uri)
        if path is not None and tmp is not None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                try:
                    os.write(fd, text.encode("utf-8"))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    # NFS may answer a retried LINK that succeeded with EEXIST: the link count tells
                    if os.stat(tmp).st_nlink < 2:
                        return False
                except OSError as exc:
                    if exc.errno not in _NO_HARD_LINKS:
                        raise
                    return self._create_exclusive(path, uri, text)  # a filesystem without hard links
            finally:
                os.unlink(tmp)
            self.sync([uri])
            return True
        out = self.fs.create(self._p(tmp_uri), True)
        try:
            out.write(bytearray(text.encode("utf-8")))
        finally:
            out.close()
        try:
            try:
                if self.fs.rename(self._p(tmp_uri), self._p(uri)):
                    return True
            except Exception:  # FileAlreadyExistsException (through py4j) on some stores
                if not self.exists(uri):
                    raise
            if self.exists(uri):
                return False
            raise OSError(f"could not rename {tmp_uri} to {uri}")
        finally:
            self.delete(tmp_uri, recursive=False)

    def _create_exclusive(self, path: Path, uri: str, text: str) -> bool:
        """``create_new`` where hard links are not to be had: ``O_EXCL``, then the text (a
        kill between the two leaves the file empty)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, text.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        self.sync([uri])
        return True

    def sync(self, uris: Iterable[str], *, directories: bool = True) -> None:
        """Make the files at ``uris`` durable on a local filesystem (``file:``): fsync each
        (and the checksum file Hadoop's local filesystem keeps beside it, ``.<name>.crc``,
        which its reads verify), then, with ``directories``, every directory from them up
        to the root, deepest first (the names renames and new files made in them). Other
        URIs: nothing to do here, a store's own durability is that of a closed file or a
        finished rename (docs/pipeline.md, "Durability")."""
        root = local_path(self.root)
        if root is None:
            return
        files: list[Path] = []
        folders: set[Path] = set()
        for uri in uris:
            path = local_path(uri)
            if path is None:
                continue
            files.append(path)
            crc = path.with_name(f".{path.name}.crc")
            if crc.exists():
                files.append(crc)
            if directories:
                folders.update(parent for parent in path.parents if parent.is_relative_to(root))
        for path in dict.fromkeys(files):
            fsync_path(path)
        for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
            try:
                fsync_path(folder)
            except OSError as exc:
                # Some filesystems (CIFS/SMB, sshfs, many FUSE ones) cannot sync a directory:
                # the files are synced, the names are as durable as the mount makes them.
                if exc.errno not in _NO_DIRECTORY_SYNC:
                    raise
                if not _warned:
                    _warned.append(True)
                    log.warning("outbox archive: %s cannot sync a directory (%s); the files are synced, their "
                                "names are as durable as the filesystem makes them (docs/pipeline.md, "
                                "\"Durability\")", folder, os.strerror(exc.errno or 0))

    def read_text(self, uri: str) -> str:
        path = local_path(uri)
        if path is not None and not path.with_name(f".{path.name}.crc").exists():
            # As ``_write_local`` wrote it: in Python, four JVM calls fewer. A file Hadoop
            # wrote, with its checksum file, is read by Hadoop, which verifies it.
            return path.read_text(encoding="utf-8")
        stream = self.fs.open(self._p(uri))
        try:
            return str(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()

    def check_writable(self) -> None:
        """Create the root and a probe file, or raise OSError: bad targets fail before any work."""
        self.mkdirs(self.root)
        probe = self.uri("_manifest", ".write-probe")
        self.write_text(probe, "ok")
        self.delete(probe, recursive=False)
