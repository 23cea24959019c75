"""The one registry behind every kind of extension: name -> class.

Every kind of extension (docs/extending.md) is a base class that owns one
:class:`Registry`; a subclass that sets ``name`` (and optionally ``aliases``) registers
itself when its module is imported. That one line next to the class is all an in-tree
method needs: the registry imports the modules of the kind's package when a name is
looked up, and a third-party package declares its classes under the kind's entry-point
group.

======================  ==========================================  ===========================
kind                    base class                                  entry-point group
======================  ==========================================  ===========================
strategy                ``cloud.strategies.Strategy``               ``fedmoe.strategies``
assignment strategy     ``cloud.assignment.AssignmentStrategy``     ``fedmoe.assignment``
aggregation strategy    ``cloud.aggregation.AggregationStrategy``   ``fedmoe.aggregation``
robust rule             ``cloud.robust.rules.RobustRule``           ``fedmoe.robust_rules``
model family            ``moe_model.models.ModelAdapter``           ``fedmoe.model_families``
objective term          ``edge_sdk.objectives.ObjectiveTerm``       ``fedmoe.objectives``
======================  ==========================================  ===========================

It lives in ``protocol`` (the lowest layer) because ``moe_model``, ``edge_sdk`` and
``cloud`` all define kinds.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import pkgutil
from importlib.metadata import EntryPoint, entry_points
from typing import Any, ClassVar, Iterable

log = logging.getLogger(__name__)


class UnknownNameError(KeyError, ValueError):
    """A name no class of the kind is registered under. A ``KeyError`` (a failed look-up)
    and a ``ValueError`` (bad configuration, so config validators report it as such);
    the message names the kind, suggests near misses and lists the known names."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry:
    """Name -> class for one kind of extension.

    Args:
        kind: what the classes are, in words (``"assignment strategy"``), for messages.
        group: the entry-point group third-party packages register under
            (``"fedmoe.assignment"``).
        package: the package whose modules hold the built-in classes, each in a module
            named for it (``-`` written ``_``). A name not registered yet is looked for in
            its module first, then in every module of the package (an alias, a module
            holding several), so a look-up imports only what it needs (a device process
            keeps the cloud's and other families' dependencies out).

    Names and aliases share one namespace per registry; two kinds may use the same name
    (the ``fedmoe`` assignment strategy and the ``fedmoe`` alias of the ``modular``
    aggregation strategy).
    """

    def __init__(self, kind: str, group: str, package: str):
        self.kind, self.group, self.package = kind, group, package
        self.base: type | None = None
        """The kind's base class (set when it is defined); entry points must subclass it."""
        self._classes: dict[str, type] = {}
        self._aliases: dict[str, str] = {}
        """alias -> the name it stands for."""
        self._builtins_loaded = False

    def add(self, cls: type, name: str, aliases: tuple[str, ...] = ()) -> type:
        """Register ``cls`` as ``name`` and each of ``aliases``; returns ``cls``.

        Raises:
            ValueError: an empty name, or a name another class already holds (a class
                registering again under its own names, as when its module is reloaded,
                replaces itself).
        """
        for n in (name, *aliases):
            if not isinstance(n, str) or not n:
                raise ValueError(f"{self.kind} {_qualname(cls)}: names must be non-empty strings, got {n!r}")
            have = self._classes.get(n)
            if have is not None and _qualname(have) != _qualname(cls):
                raise ValueError(f"{self.kind} name {n!r} is taken by {_qualname(have)}; "
                                 f"{_qualname(cls)} cannot register it too")
        for n in (name, *aliases):
            self._classes[n] = cls
        self._aliases.update((a, name) for a in aliases)
        return cls

    def get(self, name: str) -> type:
        """The class registered as ``name``: already registered, else in the kind's
        package (its module named ``name``, then every module), else the entry point of
        that name in :attr:`group`. An entry point is ``module:Class`` (the class is
        registered under the entry point's name, and takes it as its ``name`` if it has
        none of its own) or ``module`` (importing it registers the classes it defines).

        Raises:
            UnknownNameError: no such name (suggests near misses, lists the known ones).
            TypeError: the entry point of that name is not a subclass of :attr:`base`.
            Exception: whatever importing the package's modules or the entry point raises.
        """
        if name not in self._classes:
            self._import_module_named(name)
        if name not in self._classes:
            self._load_builtins()
        if name not in self._classes:
            for ep in entry_points(group=self.group, name=name):
                self._load(ep)
        if name not in self._classes:
            raise UnknownNameError(self._unknown_message(name))
        return self._classes[name]

    def names(self) -> list[str]:
        """Every name (and alias) that :meth:`get` accepts, sorted: the built-ins, what is
        registered so far and the third-party entry points (listed, not imported)."""
        self._load_builtins()
        return sorted(set(self._classes) | {ep.name for ep in entry_points(group=self.group)})

    def _import_module_named(self, name: str) -> None:
        module = name.replace("-", "_")
        if not module.isidentifier():
            return
        try:
            importlib.import_module(f"{self.package}.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"{self.package}.{module}":
                raise  # the module exists and lacks a dependency

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{self.package}.{mod.name}")
        self._builtins_loaded = True

    def _load(self, ep: EntryPoint) -> None:
        obj = ep.load()
        if not isinstance(obj, type):
            return  # a module: importing it registered what it defines
        if self.base is not None and not issubclass(obj, self.base):
            raise TypeError(f"entry point {ep.name!r} of group {self.group!r} ({ep.value}) is not a "
                            f"{self.base.__name__}, it is {_qualname(obj)}")
        if not obj.__dict__.get("name"):
            obj.name = ep.name  # a class without a name of its own takes its entry point's
        if self._classes.get(ep.name) is not obj:
            self.add(obj, ep.name)
        log.debug("%s %r loaded from entry point %s", self.kind, ep.name, ep.value)

    def _unknown_message(self, name: str) -> str:
        known = self.names()
        close = [self._aliases.get(c, c) for c in close_matches(name, known)]
        hint = f" (did you mean {' or '.join(repr(c) for c in dict.fromkeys(close))}?)" if close else ""
        listed = [f"{n} (alias {', '.join(a for a, to in self._aliases.items() if to == n)})"
                  if n in self._aliases.values() else n for n in known if n not in self._aliases]
        return (f"unknown {self.kind} {name!r}{hint}; known: {', '.join(listed) or 'none'} "
                f"(third-party ones register under the entry-point group {self.group!r})")


def close_matches(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """The names of ``known`` that ``name`` is a near miss of, closest first: the closeness
    behind every "did you mean" (unknown registered names, and the cloud's answer to a
    hello on a mistyped federation name, :mod:`cloud.near_miss`). These are difflib's close
    matches (similarity ratio at least 0.6, at most ``n`` of them), then, for a ``name`` of 3
    or more characters, the known names that contain it (``'krum'`` -> ``'multi_krum'``).
    An exact match is returned too; callers that look for near misses leave it out first."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=n, cutoff=0.6)
    if len(name) >= 3:  # a part of a longer name
        close += [k for k in known if name in k and k not in close]
    return close


class Registered:
    """Base of a kind of extension: a subclass with a ``name`` registers itself.

    A kind's base class subclasses this and sets ``registry = Registry(...)``; every
    subclass of it that sets ``name`` in its own body is registered under that name and
    its own ``aliases`` (neither is inherited: a subclass without its own ``name`` is not
    registered, and a renamed method keeps its former names only on its own class).
    """

    name: ClassVar[str] = ""
    """The name configurations select the class by."""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Former names that still select this class (configurations written before a rename)."""
    registry: ClassVar[Registry]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "registry" in cls.__dict__:
            cls.registry.base = cls
            return
        if cls.__dict__.get("name"):
            cls.registry.add(cls, cls.name, tuple(cls.__dict__.get("aliases", ())))

    @classmethod
    def lookup(cls, name: str) -> type:
        """The class of this kind registered as ``name`` (:meth:`Registry.get`).

        Raises:
            UnknownNameError: unknown name (a ``KeyError`` and a ``ValueError``; the
                message suggests near misses and lists the known names).
        """
        return cls.registry.get(name)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
