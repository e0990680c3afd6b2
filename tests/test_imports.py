"""The package's import graph, read with `ast` (nothing imported): no cycles between its modules,
inference never reaching into training, and no module taking another module's private names."""

import ast
import functools
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jetflow_jax")
PACKAGE = "jetflow_jax"
TRAINING = "jetflow_jax.train"
# Training and the embedded model's build scripts may use training; nothing else may.
MAY_IMPORT_TRAINING = ("jetflow_jax.train", "jetflow_jax.embedded")


def module_files() -> dict[str, str]:
  """Dotted module name -> file, for every .py of the package (a package is its __init__)."""
  modules = {}
  for directory, _, files in os.walk(ROOT):
    for name in files:
      if not name.endswith(".py"):
        continue
      parts = os.path.relpath(os.path.join(directory, name), os.path.dirname(ROOT))[:-3]
      parts = parts.split(os.sep)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      modules[".".join(parts)] = os.path.join(directory, name)
  return modules


def within(module: str, prefix: str) -> bool:
  return module == prefix or module.startswith(prefix + ".")


def is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class ModuleImports(ast.NodeVisitor):
  """Every import of one module (module level and inside functions), relative ones resolved,
  and its uses of private names of other package modules (imported or reached as attributes)."""

  def __init__(self, module: str, is_package: bool, modules: set[str]):
    self.module, self.modules = module, modules
    self.package = module if is_package else module.rpartition(".")[0]
    self.edges: dict[str, int] = {}  # imported package module -> first line
    self.private: list[str] = []
    self.aliases: dict[str, str] = {}  # local name -> package module it is bound to

  def add(self, target: str, line: int) -> None:
    if within(target, PACKAGE) and target != self.module:
      self.edges.setdefault(target, line)

  def visit_Import(self, node: ast.Import) -> None:
    for alias in node.names:
      self.add(alias.name, node.lineno)
      if alias.asname:
        self.aliases[alias.asname] = alias.name
      elif alias.name in self.modules:
        self.aliases[alias.name.partition(".")[0]] = alias.name.partition(".")[0]

  def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
    if node.level:
      base = self.package.split(".")
      base = base[:len(base) - (node.level - 1)]
      source = ".".join(base + ([node.module] if node.module else []))
    else:
      source = node.module or ""
    if not within(source, PACKAGE):
      return
    for alias in node.names:
      submodule = f"{source}.{alias.name}"
      if submodule in self.modules:  # `from package import module`
        self.add(submodule, node.lineno)
        self.aliases[alias.asname or alias.name] = submodule
        continue
      self.add(source, node.lineno)
      if is_private(alias.name) and source != self.module:
        self.private.append(f"{self.module}:{node.lineno} imports {alias.name} from {source}")

  def visit_Attribute(self, node: ast.Attribute) -> None:
    if is_private(node.attr):
      dotted, value = [], node.value
      while isinstance(value, ast.Attribute):
        dotted.insert(0, value.attr)
        value = value.value
      if isinstance(value, ast.Name) and value.id in self.aliases:
        owner = ".".join([self.aliases[value.id], *dotted])
        if owner in self.modules and owner != self.module:
          self.private.append(f"{self.module}:{node.lineno} uses {owner}.{node.attr}")
    self.generic_visit(node)


@functools.cache
def read_graph():
  """(module -> {imported module: line}, private-name uses) over the whole package."""
  files = module_files()
  graph, private = {}, []
  for module, path in sorted(files.items()):
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    visitor = ModuleImports(module, path.endswith("__init__.py"), set(files))
    visitor.visit(tree)
    # `import jetflow_jax.x.y` names a module; a name that is no module is an attribute of its
    # parent (`from jetflow_jax.x import name` was already resolved that way).
    graph[module] = {}
    for target, line in visitor.edges.items():
      while target not in files and "." in target:
        target = target.rpartition(".")[0]
      if target != module:
        graph[module].setdefault(target, line)
    private += visitor.private
  return graph, private


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
  """One cycle (module path, first module repeated at the end) per strongly connected group."""
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def connect(v):  # Tarjan's algorithm
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.add(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append(group)

  for v in sorted(graph):
    if v not in index:
      connect(v)
  found = []
  for group in groups:
    start = min(group)
    # Shortest way back to `start` inside the group: breadth first from it.
    parents, frontier = {start: None}, [start]
    while not any(start in graph[v] for v in frontier):
      following = []
      for v in frontier:
        for w in sorted(graph[v]):
          if w in group and w not in parents:
            parents[w] = v
            following.append(w)
      frontier = following
    last = next(v for v in frontier if start in graph[v])
    path = [last]
    while parents[path[0]] is not None:
      path.insert(0, parents[path[0]])
    found.append(path + [start])
  return found


def test_no_import_cycles():
  graph, _ = read_graph()
  found = cycles(graph)
  assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_inference_does_not_import_training():
  graph, _ = read_graph()
  bad = [f"{module}:{line} imports {target}" for module, targets in sorted(graph.items())
         for target, line in targets.items()
         if within(target, TRAINING) and not any(within(module, p) for p in MAY_IMPORT_TRAINING)]
  assert not bad, "modules outside train/ and embedded/ import training:\n" + "\n".join(bad)


def test_no_private_names_of_other_modules():
  _, private = read_graph()
  assert not private, "private names used across modules:\n" + "\n".join(private)


def test_the_checks_see_what_they_look_for():
  """The walk itself: relative imports resolve, function-level imports count, cycles are found."""
  source = ("from . import b\nfrom .b import _hidden\n"
            "def f():\n  from ..train import loop\n  return b._secret\n")
  visitor = ModuleImports("jetflow_jax.x.a", False, {"jetflow_jax.x.b", "jetflow_jax.train.loop"})
  visitor.visit(ast.parse(source))
  assert set(visitor.edges) == {"jetflow_jax.x.b", "jetflow_jax.train.loop"}
  assert [p.split(" ", 1)[1] for p in visitor.private] == [
      "imports _hidden from jetflow_jax.x.b", "uses jetflow_jax.x.b._secret"]
  graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}
  assert cycles(graph) == [["a", "b", "c", "a"]]
