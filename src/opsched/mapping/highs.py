"""The mapping MILP on HiGHS (through OR-Tools' MathOpt, which ships it): ``milp.py``'s CP-SAT model read back
as a mixed-integer linear program, so that DiviML's formulation is stated once and either solver can take it.

Each CP-SAT constraint becomes linear rows over the model's variables (a negated literal is ``1 - x``):

- a linear constraint enforced by literals l1..lm: its row relaxed by ``M * sum(1 - l_i)``, M the most the
  row's activity can pass its bound over the variables' domains (the big-M form);
- exactly-one, at-most-one, bool-or, bool-and: their rows over 0/1 variables;
- intervals: those sharing start and end whose presence literals are exclusive (in one exactly-one or
  at-most-one: a unit's devices for latency, its piece counts on a device for throughput) are one job, with
  ``end - start - sum(size_i * p_i)`` within ``+-M (1 - sum p_i)``: DiviML's own row (its constraint 2, the
  job's duration the sum of size indicators times durations), exact and tight whenever the job is placed, where
  one big-M row per interval would let the LP relaxation shrink every duration to nothing;
- no-overlap: per pair of jobs that can both be present, an order variable and a big-M row per order.

CP-SAT needs integer times; here they are continuous: once the 0/1 variables are fixed, the rows left on the
times are differences with integer bounds, whose optimum is a whole number of steps, so nothing is lost and
HiGHS does not branch on them. The gap tolerance is half a step for the same reason.
"""

from __future__ import annotations

import datetime
import itertools
import math
import time
from dataclasses import dataclass

from opsched.mapping import MappingError

INT64_LIMIT = 2**63 - 1  # CP-SAT's bound for an unbounded side of a domain
TIME_UNITS = 1e2  # the most time units HiGHS sees (see _Translation)
# HiGHS's settings to solve with, in turn, while it ends in a solve error. On some small models (_random_problem
# seed 492 of the tests: 3 independent units, 3 devices) its feasibility-jump heuristic finds a point 1e-6 off a
# row, which the MIP search accepts and then calls optimal; HiGHS's final check against the same tolerance then
# rejects it ("MIP solver claims optimality, but with ... primal infeasibilities") and sets the status to solve
# error, which MathOpt raises as an error (here a StatusNotOk whose conversion fails with an AttributeError). Of
# 1,200 random models (3 and 5 units, 3 devices) 4 ended so; without the heuristic 1 did, another one.
# Each retry adds its options to the ones before.
RETRIES = ({}, {"bool_options": {"mip_heuristic_run_feasibility_jump": False}},
           {"string_options": {"presolve": "off"}})
KINDS = ("linear", "exactly_one", "at_most_one", "bool_or", "bool_and", "interval", "no_overlap")

Terms = dict[int, float]   # variable index (of the MILP) -> coefficient
Affine = tuple[Terms, float]


@dataclass
class HighsResult:
    status: str          # as CP-SAT names it: OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN
    values: list[float]  # by CP-SAT variable index; empty without a solution
    bound: float         # the best bound HiGHS proved on the objective


def solve_highs(model, time_limit: float) -> HighsResult:
    """Solve the CP-SAT ``model`` (a ``cp_model.CpModel`` with an objective to minimise) with HiGHS within
    ``time_limit`` seconds, its solution hint as HiGHS's starting point."""
    from ortools.math_opt.python import mathopt

    started = time.perf_counter()
    built = _Translation(model.Proto())
    left = max(0.05, time_limit - (time.perf_counter() - started))  # the translation counts (0.13 s for 110 units)
    params = mathopt.SolveParameters(time_limit=datetime.timedelta(seconds=left), relative_gap_tolerance=0.0,
                                     absolute_gap_tolerance=0.5 / built.unit)
    model_params = mathopt.ModelSolveParameters(solution_hints=[mathopt.SolutionHint(variable_values={
        built.variables[v]: x if built.binary[v] else x / built.unit for v, x in built.hint.items()})]
    ) if built.hint else None
    result = None
    for attempt, options in enumerate(RETRIES):
        for kind, values in options.items():
            getattr(params.highs, kind).update(values)
        if attempt:
            params.time_limit = datetime.timedelta(seconds=max(0.05, time_limit - (time.perf_counter() - started)))
        try:
            result = mathopt.solve(built.model, mathopt.SolverType.HIGHS, params=params, model_params=model_params)
            break
        except Exception as error:  # noqa: BLE001 - MathOpt's status errors (HiGHS missing or failing) vary by build
            cause = error.__context__ or error  # MathOpt's own conversion of HiGHS's status can fail (see RETRIES)
            failure = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
    if result is None:
        raise MappingError(f"HiGHS failed on the mapping MILP ({failure})")
    reason = result.termination.reason
    found = result.has_primal_feasible_solution()
    status = {mathopt.TerminationReason.OPTIMAL: "OPTIMAL", mathopt.TerminationReason.INFEASIBLE: "INFEASIBLE",
              }.get(reason, "FEASIBLE" if found else "UNKNOWN")
    solution = result.variable_values() if found else {}
    values = [solution[v] * (1 if built.binary[i] else built.unit)
              for i, v in enumerate(built.variables[:built.cp_variables])] if found else []
    return HighsResult(status, values, result.termination.objective_bounds.dual_bound * built.unit)


class _Translation:
    """The MathOpt model of a CP-SAT model proto: ``variables[i]`` stands for CP-SAT variable i (then the
    order variables of no-overlap pairs); a 0/1 variable is binary, any other continuous, in ``unit`` steps.

    HiGHS works to absolute tolerances (about 1e-7): with times in steps (up to 1e7) and big-M rows as large it
    ended "optimal" with a row 1e-6 off after unscaling and then called that a solve error. So it gets times in
    units of ``unit`` steps, at most ``TIME_UNITS`` of them, each row holding a time divided by ``unit``
    (``lower``, ``upper`` and every expression here stay in steps). On 146 small models (latency and
    throughput, 3-8 units) solved for 3 s each: 1e4 units 2 solve errors of 56, 1e3 units 1 of 56 and 3 of 90,
    1e2 units none of either, every optimum it proved CP-SAT's; 1e1 units "proved" 6 wrong optima of 90 (too
    coarse for a half-step gap). Loosening HiGHS's MIP feasibility tolerance instead made it worse."""

    def __init__(self, proto):
        from ortools.math_opt.python import mathopt

        self.model = mathopt.Model()
        self.variables, self.lower, self.upper, self.binary = [], [], [], []
        domains = [list(var.domain) for var in proto.variables]  # (the wrapper's repeated fields read [-1] as [0])
        bounds = [(_bound(d[0]), _bound(d[-1])) for d in domains]
        largest = max((max(abs(lo), abs(hi)) for lo, hi in bounds if not 0 <= lo <= hi <= 1
                       and math.isfinite(lo) and math.isfinite(hi)), default=1.0)
        self.unit = 10.0 ** max(0, math.ceil(math.log10(max(1.0, largest) / TIME_UNITS)))
        for lo, hi in bounds:
            self._new(lo, hi, binary=lo >= 0 and hi <= 1)
        self.cp_variables = len(self.variables)
        hint = proto.solution_hint
        self.hint = {v: float(x) for v, x in zip(hint.vars, hint.values, strict=True)}  # MILP variable -> value
        exclusive: dict[int, set[int]] = {}  # literal -> the exactly/at-most-one constraints it is in
        intervals: dict[int, object] = {}
        overlaps = []
        for index, c in enumerate(proto.constraints):
            kind = next((k for k in KINDS if _has(c, k)), "other than " + ", ".join(KINDS))
            enforced = [self._literal(lit) for lit in c.enforcement_literal]
            if kind == "linear":
                domain = list(c.linear.domain)
                if len(domain) != 2:
                    raise MappingError("HiGHS: a CP-SAT linear constraint with holes in its domain has no row")
                self._row((self._sum(c.linear.vars, c.linear.coeffs), 0.0), _bound(domain[0]), _bound(domain[1]),
                          enforced)
            elif kind in ("exactly_one", "at_most_one", "bool_or"):
                literals = getattr(c, kind).literals
                lo, hi = {"exactly_one": (1, 1), "at_most_one": (-math.inf, 1), "bool_or": (1, math.inf)}[kind]
                self._row(_add(*(self._literal(lit) for lit in literals)), lo, hi, enforced)
                if kind != "bool_or" and not enforced:
                    for lit in literals:
                        exclusive.setdefault(lit, set()).add(index)
            elif kind == "bool_and":
                for lit in c.bool_and.literals:
                    self._row(self._literal(lit), 1, 1, enforced)
            elif kind == "interval":
                intervals[index] = c
            elif kind == "no_overlap":
                overlaps.append(list(c.no_overlap.intervals))
            else:
                raise MappingError(f"HiGHS: a CP-SAT constraint {kind} has no linear form here")
        job_of, jobs = self._jobs(intervals, exclusive)
        for members in overlaps:
            for a, b in itertools.combinations(list(dict.fromkeys(job_of[i] for i in members)), 2):
                (start_a, end_a, on_a), (start_b, end_b, on_b) = jobs[a], jobs[b]
                first = self._new(0, 1, binary=True)
                ends_first = self._hinted(_add(end_a, _scaled(start_b, -1)))
                if ends_first is not None:  # a start with both jobs' times: their order in it
                    self.hint[len(self.variables) - 1] = float(ends_first <= 0)
                self._row(_add(end_a, _scaled(start_b, -1)), -math.inf, 0, [first, on_a, on_b])
                self._row(_add(end_b, _scaled(start_a, -1)), -math.inf, 0, [_not(first), on_a, on_b])
        objective = proto.objective
        if _has(proto, "floating_point_objective") or not objective.vars:
            raise MappingError("HiGHS: the CP-SAT model has no integer objective to minimise")
        terms = self._sum(objective.vars, objective.coeffs)
        # in units of ``unit`` steps, as the rows holding a time
        self.model.minimize(sum(c * self.variables[v] / (self.unit if self.binary[v] else 1)
                                for v, c in terms.items()) + objective.offset / self.unit)

    def _jobs(self, intervals: dict[int, object], exclusive: dict[int, set[int]]
              ) -> tuple[dict[int, int], list[tuple[Affine, Affine, Affine]]]:
        """The jobs, (start, end, presence), intervals sharing start and end with exclusive presences being
        one job, whose duration rows are written here; and each interval's job."""
        groups: dict[tuple, list[int]] = {}
        for index, c in intervals.items():
            key = (_key(c.interval.start), _key(c.interval.end))
            groups.setdefault(key, []).append(index)
        job_of: dict[int, int] = {}
        jobs: list[tuple[Affine, Affine, Affine]] = []
        for members in groups.values():
            presences = [intervals[i].enforcement_literal for i in members]
            together = all(len(p) == 1 for p in presences) and set.intersection(
                *(exclusive.get(p[0], set()) for p in presences))
            constant = all(not intervals[i].interval.size.vars for i in members)
            for part in ([members] if together and constant else [[i] for i in members]):
                first = intervals[part[0]].interval
                start, end = self._expression(first.start), self._expression(first.end)
                on = _add(*(self._enforcement(intervals[i]) for i in part))
                if len(part) == 1 and intervals[part[0]].interval.size.vars:
                    length = _add(end, _scaled(start, -1), _scaled(self._expression(first.size), -1))
                    self._row(length, 0, 0, [on])
                else:
                    length = _add(end, _scaled(start, -1), *(_scaled(self._enforcement(intervals[i]),
                                                                     -intervals[i].interval.size.offset)
                                                             for i in part))
                    self._within(length, on)
                job_of.update((i, len(jobs)) for i in part)
                jobs.append((start, end, on))
        return job_of, jobs

    def _within(self, length: Affine, on: Affine) -> None:
        """``length`` is 0 when ``on`` is 1, free (within its range) when 0: ``|length| <= M (1 - on)``."""
        lo, hi = self._range(length)
        self._row(_add(length, _scaled(on, max(0.0, hi))), -math.inf, max(0.0, hi))
        self._row(_add(length, _scaled(on, min(0.0, lo))), min(0.0, lo), math.inf)

    def _row(self, expr: Affine, lo: float, hi: float, enforced: list[Affine] = ()) -> None:
        """``lo <= expr <= hi`` when every literal of ``enforced`` is 1 (big-M over the expression's range)."""
        terms, constant = expr
        least, most = self._range(expr)
        for bound, sign in ((hi, 1), (lo, -1)):
            if not math.isfinite(bound):
                continue
            slack = (most - bound) if sign > 0 else (bound - least)
            if slack <= 0:
                continue  # holds whatever the variables are
            row = dict(terms)
            rhs = bound - constant
            for lit_terms, lit_constant in enforced:
                # expr <= hi + slack (1 - lit) (">=" mirrored): lit's terms moved to the left, its constant right
                for v, c in lit_terms.items():
                    row[v] = row.get(v, 0.0) + sign * slack * c
                rhs += sign * slack * (1 - lit_constant)
            div = 1.0 if all(self.binary[v] for v, x in row.items() if x) else self.unit
            c = self.model.add_linear_constraint(lb=-math.inf if sign > 0 else rhs / div,
                                                 ub=rhs / div if sign > 0 else math.inf)
            for v, coefficient in row.items():
                if coefficient:  # a time t = unit t' keeps its coefficient in a row divided by unit
                    c.set_coefficient(self.variables[v], coefficient / div if self.binary[v] else coefficient)

    def _hinted(self, expr: Affine) -> float | None:
        """``expr`` at the solution hint, None when the hint leaves out one of its variables."""
        terms, constant = expr
        if any(v not in self.hint for v in terms):
            return None
        return constant + sum(c * self.hint[v] for v, c in terms.items())

    def _range(self, expr: Affine) -> tuple[float, float]:
        terms, constant = expr
        least = constant + sum(min(c * self.lower[v], c * self.upper[v]) for v, c in terms.items())
        most = constant + sum(max(c * self.lower[v], c * self.upper[v]) for v, c in terms.items())
        return least, most

    def _new(self, lo: float, hi: float, binary: bool) -> Affine:
        unit = 1.0 if binary else self.unit
        self.variables.append(self.model.add_variable(lb=lo / unit, ub=hi / unit, is_integer=binary))
        self.lower.append(lo)
        self.upper.append(hi)
        self.binary.append(binary)
        return {len(self.variables) - 1: 1.0}, 0.0

    def _literal(self, ref: int) -> Affine:
        return ({ref: 1.0}, 0.0) if ref >= 0 else ({~ref: -1.0}, 1.0)

    def _enforcement(self, c) -> Affine:
        if len(c.enforcement_literal) > 1:
            raise MappingError("HiGHS: an interval with several presence literals has no linear form here")
        return self._literal(c.enforcement_literal[0]) if c.enforcement_literal else ({}, 1.0)

    def _expression(self, e) -> Affine:
        return self._sum(e.vars, e.coeffs), float(e.offset)

    def _sum(self, variables, coeffs) -> Terms:
        terms: Terms = {}
        for v, c in zip(variables, coeffs, strict=True):
            terms[v] = terms.get(v, 0.0) + c
        return terms


def _has(message, field: str) -> bool:
    # OR-Tools 9.15 (here) hands out CP-SAT's proto as a wrapper with has_<field>(); older ones as a protobuf message
    return getattr(message, f"has_{field}")() if hasattr(message, f"has_{field}") else message.HasField(field)


def _bound(x: int) -> float:
    return math.inf if x >= INT64_LIMIT else -math.inf if x <= -INT64_LIMIT else float(x)


def _key(e) -> tuple:
    return tuple(e.vars), tuple(e.coeffs), e.offset


def _add(*parts: Affine) -> Affine:
    terms: Terms = {}
    constant = 0.0
    for t, c in parts:
        for v, x in t.items():
            terms[v] = terms.get(v, 0.0) + x
        constant += c
    return terms, constant


def _scaled(part: Affine, factor: float) -> Affine:
    return {v: factor * x for v, x in part[0].items()}, factor * part[1]


def _not(literal: Affine) -> Affine:
    return _add(({}, 1.0), _scaled(literal, -1))
