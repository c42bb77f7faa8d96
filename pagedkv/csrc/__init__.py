"""pagedkv's native sources: the ``.c`` / ``.cpp`` files of this package, data only.

They ship in the wheel (``pyproject.toml`` package-data lists ``*.c`` and ``*.cpp`` of this
package; this file keeps the directory a package so that ``packages.find`` includes it). Their
one builder and every Python binding of them live in :mod:`pagedkv.ops` (``pagedkv.ops.build``
compiles and caches, ``pagedkv.ops.<source stem>`` loads and calls each library).
"""
