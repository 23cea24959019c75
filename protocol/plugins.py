"""Registries of named plug-in classes, shared by every layer: the cloud's strategies and
their parts (:mod:`cloud.strategy`) and the device's objective terms
(:mod:`edge_sdk.objectives`)."""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points
from typing import Any, ClassVar


class Registered:
    """Base of a plug-in family: subclasses with a ``name`` register themselves.

    A family's base class sets ``_registry = {}`` (its own dict) and ``_package`` (the
    package whose modules hold the built-in members); the family's entry-point group is
    ``fedmoe.{last part of _package}``.
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Former names that still select this class (configs written before a rename)."""
    _registry: ClassVar[dict[str, type]]
    _package: ClassVar[str]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "_registry" in cls.__dict__:
            return
        if cls.name:
            for name in (cls.name, *cls.__dict__.get("aliases", ())):
                cls._registry[name] = cls

    @classmethod
    def lookup(cls, name: str) -> type:
        """The class registered as ``name``. A name not registered yet is looked for in
        the modules of the family's package, then in a third-party package registered
        under the entry-point group ``fedmoe.{family}`` (``fedmoe.strategies``,
        ``fedmoe.assignment``, ``fedmoe.aggregation``, ``fedmoe.objectives``).

        Raises:
            KeyError: unknown name (the message lists the known ones).
        """
        family = cls._package.rsplit(".", 1)[-1]
        if name not in cls._registry:
            pkg = importlib.import_module(cls._package)
            for mod in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{cls._package}.{mod.name}")
        if name not in cls._registry:
            for ep in entry_points(group=f"fedmoe.{family}", name=name):
                ep.load()
        if name not in cls._registry:
            raise KeyError(f"unknown {family} strategy {name!r}; known: {sorted(cls._registry)}")
        return cls._registry[name]
