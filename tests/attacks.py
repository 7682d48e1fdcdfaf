"""What a hostile reader does to reach a forbidden function another way, or to work out of a check's sight, for the
exercise tests."""

import ast
import importlib.util
import inspect
import multiprocessing
import os
import textwrap
import threading
import types


def loaded_again(module):
    """The module's file executed again as a new module (what importlib.reload does, without touching the original)."""
    spec = importlib.util.spec_from_file_location(module.__name__ + "_again", module.__file__)
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    return again


def copy_of(fn):
    """A new function object with fn's code, made before the check runs."""
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class _Renamed(ast.NodeTransformer):
    """Every argument and local variable renamed, the docstring dropped and a `pass` added: a copy that reads as
    someone else's."""

    def __init__(self, names):
        self.names = names

    def visit_arg(self, node):
        node.arg = self.names.get(node.arg, node.arg)
        return node

    def visit_Name(self, node):
        node.id = self.names.get(node.id, node.id)
        return node

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        node.name = self.names.get(node.name, node.name)
        body = node.body[1:] if ast.get_docstring(node) else node.body
        node.body = [ast.Pass()] + body
        return node


def recompiled(fn, rename=False, filename="<your notebook cell>"):
    """fn compiled again from its source under another file name, in a namespace like its module's: the library's
    code exec'd from inspect.getsource. With `rename`: the function and its locals renamed, its docstring dropped,
    a `pass` added."""
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    if rename:
        local = set(fn.__code__.co_varnames) | {fn.__name__}
        tree = _Renamed({n: f"my_{n}" for n in local}).visit(tree)
    namespace = dict(fn.__globals__)
    exec(compile(ast.unparse(tree), filename, "exec"), namespace)
    return namespace[f"my_{fn.__name__}" if rename else fn.__name__]


def _run_and_send(conn, fn, args):
    conn.send(fn(*args))
    conn.close()


def in_child_process(fn, *args, method="fork"):
    """fn(*args) run in a child process (multiprocessing, start method `method`), its result sent back."""
    ctx = multiprocessing.get_context(method)
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_run_and_send, args=(child, fn, args))
    process.start()
    out = parent.recv()
    process.join()
    return out


def forked(fn, *args):
    """fn(*args) run in a child made by os.fork, its result (an int) sent back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                              # the child: answer, then leave at once
        os.write(write, str(fn(*args)).encode())
        os._exit(0)
    os.close(write)
    out = os.read(read, 64)
    os.waitpid(pid, 0)
    return int(out)


def in_thread(fn, *args):
    """fn(*args) run in a thread started for it, waited for."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]
