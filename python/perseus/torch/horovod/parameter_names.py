"""The names a DistributedOptimizer gives its parameters' collectives, checked as
Horovod checks ``named_parameters``."""


def parameter_names(param_groups, named_parameters, working=lambda p: p):
    """``{parameter: name}`` for every parameter in ``param_groups``.

    ``named_parameters`` is ``model.named_parameters()`` or None (then each parameter is
    ``allreduce.noname.<group>.<index>``). ``working(p)`` is the tensor whose gradient
    backward fills for the group entry ``p`` (AMP O2's model parameter for a master).
    Raises ``ValueError`` for entries that are not pairs, duplicate names, and
    parameters left unnamed."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", working(v))
                            for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in named_parameters]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    all_ids = {id(working(v)) for group in param_groups for v in group["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
    return {v: k for k, v in named_parameters}


def name_added_group(names, param_groups, working=lambda p: p):
    """Names, in ``names`` (``{parameter: name}``), the parameters of the group just
    added to ``param_groups`` (its last) that ``named_parameters`` did not name:
    ``allreduce.noname.<group>.<index>``, the same on every rank that added the same
    groups. Returns the parameters named. When such a name is taken, the group is
    removed again and ``ValueError`` raised, with nothing named."""
    i = len(param_groups) - 1
    taken = set(names.values())
    new = {}
    for j, p in enumerate(param_groups[i]["params"]):
        w = working(p)
        if w in names:
            continue
        name = f"allreduce.noname.{i}.{j}"
        if name in taken:
            param_groups.pop()
            raise ValueError(f"a parameter of the added group {i} would be named {name!r}, "
                             "which named_parameters gave another parameter: name the "
                             "added parameters in named_parameters")
        new[w] = name
    names.update(new)
    return list(new)
