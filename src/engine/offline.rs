//! PERSEUS_OFFLINE_NEG: once the steps repeat, ranks stop asking the
//! coordinator and run the recorded step themselves.
//!
//! The coordinator watches the allreduces it answers for process set 0 and
//! splits them into steps (a step ends where a name comes again). When three
//! steps in a row carried the same tensors (names, shapes, types, reductions,
//! plans), it offers the last step's groups as a schedule
//! ([`Response::Offline`]). Each rank acknowledges and from then on holds its
//! new requests; the acknowledgements cut every rank's request stream at a
//! known point. When all are in, the coordinator answers
//! [`Response::Switch`]: `go` when nothing is half negotiated (no name that
//! some ranks asked for and others not yet), with the names of the step in
//! progress that were already answered, which the schedule's first pass
//! skips; otherwise the held requests are sent up as before.
//!
//! Running offline, a rank takes the groups in order. Before the next ones it
//! votes with every other rank (a one-byte max over the mesh, much cheaper
//! than a trip through rank 0), saying how many groups in a row it holds
//! whole, or that it cannot go on (a request off the schedule: another name,
//! shape, type, reduction or process set, a barrier, a join, a shutdown; or a
//! caller waiting on a tensor that a missing one holds back). Every rank then
//! runs as many groups as the rank holding the fewest, so one vote serves a
//! whole step when its gradients are all in. A rank that cannot go on sends
//! every rank back to negotiation at the same group, with every held request
//! sent up in order, so nothing is lost and no rank runs a collective the
//! others do not.

use super::message::{OpKind, Request, Response};
use super::outgoing::Outgoing;
use crate::dtype::{DataType, ReduceOp};
use crate::plan::Plan;
use std::collections::{HashMap, HashSet, VecDeque};

/// What must agree for a tensor to run as recorded.
#[derive(Debug, Clone, PartialEq)]
struct Sig {
    shape: Vec<i64>,
    dtype: DataType,
    op: ReduceOp,
    prescale: f64,
    postscale: f64,
    plan: Plan,
}

impl Sig {
    fn of_request(r: &Request) -> Option<Sig> {
        (r.kind == OpKind::Allreduce && r.process_set == 0).then(|| Sig {
            shape: r.shape.clone(),
            dtype: r.dtype,
            op: r.op,
            prescale: r.prescale,
            postscale: r.postscale,
            plan: r.plan,
        })
    }

    /// Name and signature of every tensor of a set-0 allreduce.
    fn of_group(g: &Response) -> Option<Vec<(String, Sig)>> {
        match g {
            Response::Op {
                kind: OpKind::Allreduce,
                process_set: 0,
                names,
                shapes,
                dtype,
                op,
                prescale,
                postscale,
                plan,
                ..
            } => Some(
                names
                    .iter()
                    .zip(shapes)
                    .map(|(n, s)| {
                        let sig = Sig {
                            shape: s.clone(),
                            dtype: *dtype,
                            op: *op,
                            prescale: *prescale,
                            postscale: *postscale,
                            plan: *plan,
                        };
                        (n.clone(), sig)
                    })
                    .collect(),
            ),
            _ => None,
        }
    }
}

/// Tensors of one step, sorted by name.
type StepSig = Vec<(String, Sig)>;

fn step_sig(groups: &[Response]) -> StepSig {
    let mut s: StepSig = groups.iter().filter_map(Sig::of_group).flatten().collect();
    s.sort_by(|a, b| a.0.cmp(&b.0));
    s
}

/// Steps that must repeat before the schedule is offered.
const STABLE_STEPS: usize = 3;

/// An offer waiting for every rank's acknowledgement.
struct Offer {
    acked: Vec<bool>,
    /// How many ranks acknowledged.
    acks: usize,
    /// Names of the offered step's last group.
    last: HashSet<String>,
    /// Names answered since the offer (the step in progress).
    skip: Vec<String>,
    /// Something other than a set-0 allreduce was answered meanwhile.
    spoiled: bool,
}

/// The coordinator's side: finds repeating steps and runs the switch.
pub struct Detector {
    size: usize,
    done: VecDeque<StepSig>,
    cur: Vec<Response>,
    cur_names: HashSet<String>,
    offer: Option<Offer>,
    /// After a cancelled switch: steps are counted from the group holding
    /// these names (the last group of the offered step), see `settle`.
    start_at: Option<HashSet<String>>,
}

impl Detector {
    /// A detector for a job of `size` ranks.
    pub fn new(size: usize) -> Detector {
        Detector {
            size,
            done: VecDeque::new(),
            cur: Vec::new(),
            cur_names: HashSet::new(),
            offer: None,
            start_at: None,
        }
    }

    fn forget(&mut self) {
        self.done.clear();
        self.cur.clear();
        self.cur_names.clear();
    }

    /// Looks at the answers about to be sent, in order, and inserts an offer
    /// right before the one that completes the third equal step. `settled`:
    /// no rank has joined, so the steps may be trusted. Before, not after:
    /// a rank cannot begin the next step before that answer, so every rank
    /// holds its next requests from then on and the switch finds nothing
    /// half negotiated (after it, a fast rank's next step could already be
    /// on its way, and the switch would be cancelled at the same point of
    /// every step).
    pub fn watch(&mut self, out: &mut Outgoing, settled: bool) {
        let mut i = 0;
        while i < out.len() {
            if let Some(offer) = self.observe(&out[i].1, settled) {
                out.insert(i, ((0..self.size).collect(), offer));
                i += 1;
            }
            i += 1;
        }
    }

    fn observe(&mut self, resp: &Response, settled: bool) -> Option<Response> {
        if matches!(resp, Response::Cached { .. }) {
            return None;
        }
        let group = Sig::of_group(resp);
        if let Some(offer) = &mut self.offer {
            match &group {
                Some(g) => offer.skip.extend(g.iter().map(|(n, _)| n.clone())),
                None => offer.spoiled = true,
            }
            return None;
        }
        let Some(g) = group.filter(|_| settled) else {
            self.forget();
            return None;
        };
        if let Some(start) = &self.start_at {
            if !g.iter().any(|(n, _)| start.contains(n)) {
                return None;
            }
            self.start_at = None;
            self.forget();
        }
        if g.iter().any(|(n, _)| self.cur_names.contains(n)) {
            self.done.push_back(step_sig(&self.cur));
            if self.done.len() >= STABLE_STEPS {
                self.done.pop_front();
            }
            self.cur.clear();
            self.cur_names.clear();
        }
        self.cur_names.extend(g.into_iter().map(|(n, _)| n));
        self.cur.push(resp.clone());
        // Sort and compare only once the step has as many tensors as the last ones.
        let stable = self.done.len() == STABLE_STEPS - 1
            && self.done.iter().all(|d| d.len() == self.cur_names.len())
            && {
                let now = step_sig(&self.cur);
                self.done.iter().all(|d| *d == now)
            };
        if !stable {
            return None;
        }
        let groups = std::mem::take(&mut self.cur);
        self.forget();
        // The offer goes out ahead of this last group of the step (see
        // `watch`); the group still closes that step, so the next step's
        // first pass starts from the schedule's beginning.
        self.offer = Some(Offer {
            acked: vec![false; self.size],
            acks: 0,
            last: Sig::of_group(resp)
                .unwrap_or_default()
                .into_iter()
                .map(|(n, _)| n)
                .collect(),
            skip: Vec::new(),
            spoiled: false,
        });
        Some(Response::Offline { groups })
    }

    /// Rank `rank` acknowledged the offer (ignored when none is open).
    pub fn ack(&mut self, rank: usize) {
        if let Some(o) = self.offer.as_mut() {
            if o.acked.get(rank) == Some(&false) {
                o.acked[rank] = true;
                o.acks += 1;
            }
        }
    }

    /// Once every rank acknowledged: the switch to send to everyone. `quiet`:
    /// nothing is half negotiated and no rank has joined.
    pub fn settle(&mut self, quiet: bool) -> Option<(Vec<usize>, Response)> {
        if self.offer.as_ref()?.acks < self.size {
            return None;
        }
        let offer = self.offer.take()?;
        let distinct = offer.skip.iter().collect::<HashSet<_>>().len() == offer.skip.len();
        let go = quiet && !offer.spoiled && distinct;
        if !go {
            // Counted from another group, the steps may begin where ranks
            // submit a whole step at once: the offer then reaches them with
            // part of their next step already sent, every time. Count them
            // next from the group that closed this one's step, which the
            // ranks cannot have passed when the offer arrives.
            self.start_at = Some(offer.last);
        }
        let skip = if go { offer.skip } else { Vec::new() };
        Some(((0..self.size).collect(), Response::Switch { go, skip }))
    }
}

/// A rank's side while running offline: the recorded groups and where it is.
pub struct Schedule {
    groups: Vec<Response>,
    sigs: HashMap<String, Sig>,
    pos: usize,
    skip: HashSet<String>,
}

impl Schedule {
    /// The schedule of an accepted offer; `skip` names are left out of the
    /// first pass.
    pub fn new(groups: Vec<Response>, skip: Vec<String>) -> Schedule {
        let sigs = groups.iter().filter_map(Sig::of_group).flatten().collect();
        Schedule {
            groups,
            sigs,
            pos: 0,
            skip: skip.into_iter().collect(),
        }
    }

    /// True when `req` is one of the recorded tensors, unchanged.
    pub fn fits(&self, req: &Request) -> bool {
        match (Sig::of_request(req), self.sigs.get(&req.name)) {
            (Some(s), Some(rec)) => s == *rec,
            _ => false,
        }
    }

    /// The next group to run (less the skipped names of the first pass).
    pub fn next(&mut self) -> Response {
        loop {
            if self.pos == self.groups.len() {
                self.pos = 0;
                self.skip.clear();
            }
            let g = &self.groups[self.pos];
            if self.skip.is_empty() {
                return g.clone();
            }
            if let Some(g) = without(g, &self.skip) {
                return g;
            }
            self.pos += 1;
        }
    }

    /// The group returned by [`Schedule::next`] ran.
    pub fn advance(&mut self) {
        self.pos += 1;
    }

    /// How many of the groups [`Schedule::next`] would return from here, in a row
    /// (at most as many as the schedule has), `ready` accepts.
    pub fn ready_ahead(&self, ready: impl Fn(&Response) -> bool) -> usize {
        let (mut pos, mut first_pass, mut count) = (self.pos, !self.skip.is_empty(), 0);
        // A first pass may skip whole groups; the second has none to skip.
        for _ in 0..2 * self.groups.len() {
            if count == self.groups.len() {
                break;
            }
            if pos == self.groups.len() {
                pos = 0;
                first_pass = false;
            }
            let g = if first_pass {
                without(&self.groups[pos], &self.skip)
            } else {
                Some(self.groups[pos].clone())
            };
            pos += 1;
            match g {
                None => continue,
                Some(g) if ready(&g) => count += 1,
                Some(_) => break,
            }
        }
        count
    }
}

/// `g` less the tensors named in `skip`; `None` when nothing is left.
fn without(g: &Response, skip: &HashSet<String>) -> Option<Response> {
    let mut g = g.clone();
    if let Response::Op { names, shapes, .. } = &mut g {
        let kept: Vec<(String, Vec<i64>)> = names
            .drain(..)
            .zip(shapes.drain(..))
            .filter(|(n, _)| !skip.contains(n))
            .collect();
        if kept.is_empty() {
            return None;
        }
        (*names, *shapes) = kept.into_iter().unzip();
    }
    Some(g)
}

/// Where a rank stands with offline negotiation.
pub enum Mode {
    /// Every request goes to the coordinator.
    Negotiated,
    /// The coordinator offered these groups; requests are held until the switch.
    Offered(Vec<Response>),
    /// Running the schedule; requests are held and matched against it.
    Running(Schedule),
}

impl Mode {
    /// True when new requests are held instead of sent.
    pub fn holds(&self) -> bool {
        !matches!(self, Mode::Negotiated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::coordinator::Coordinator;
    use crate::engine::message::{decode_responses, encode_responses};

    fn ar(name: &str, n: i64) -> Request {
        let mut r = Request::new(OpKind::Allreduce, name, 0);
        r.dtype = DataType::F32;
        r.shape = vec![n];
        r
    }

    /// Both ranks submit `names` one at a time; returns everything answered.
    fn step(c: &mut Coordinator, names: &[&str]) -> Vec<Response> {
        let mut got = Vec::new();
        for n in names {
            got.extend(c.submit(0, vec![ar(n, 4)]).into_iter().map(|(_, r)| r));
            got.extend(c.submit(1, vec![ar(n, 4)]).into_iter().map(|(_, r)| r));
        }
        got
    }

    fn offer_of(got: &[Response]) -> Option<Vec<Response>> {
        got.iter().find_map(|r| match r {
            Response::Offline { groups } => Some(groups.clone()),
            _ => None,
        })
    }

    #[test]
    fn offers_after_three_equal_steps_and_switches_when_all_ack() {
        let mut c = Coordinator::new(2, 1 << 20).with_offline(true);
        assert!(offer_of(&step(&mut c, &["a", "b"])).is_none());
        assert!(
            offer_of(&step(&mut c, &["b", "a"])).is_none(),
            "order may vary"
        );
        let got = step(&mut c, &["a", "b"]);
        let groups = offer_of(&got).expect("third equal step is offered");
        assert_eq!(groups.len(), 2);
        // Ahead of the step's last answer, which still closes the step.
        assert!(matches!(&got[got.len() - 2], Response::Offline { .. }));
        assert!(matches!(got.last(), Some(Response::Op { names, .. }) if names == &["b"]));
        // The schedule survives the wire.
        let back = decode_responses(&encode_responses(&[Response::Offline {
            groups: groups.clone(),
        }]))
        .unwrap();
        assert_eq!(back, vec![Response::Offline { groups }]);
        // Rank 1 had sent "a" of the next step before it saw the offer.
        assert!(c.submit(1, vec![ar("a", 4)]).is_empty());
        assert!(c
            .submit(1, vec![Request::new(OpKind::OfflineAck, "o", 0)])
            .is_empty());
        let out = c.submit(0, vec![ar("a", 4)]);
        assert!(matches!(&out[0].1, Response::Op { names, .. } if names == &["a"]));
        let out = c.submit(0, vec![Request::new(OpKind::OfflineAck, "o", 0)]);
        assert_eq!(
            out.last().map(|o| &o.1),
            Some(&Response::Switch {
                go: true,
                skip: vec!["a".into()]
            })
        );
    }

    #[test]
    fn half_negotiated_name_cancels_the_switch() {
        let mut c = Coordinator::new(2, 1 << 20).with_offline(true);
        for _ in 0..2 {
            step(&mut c, &["a"]);
        }
        assert!(offer_of(&step(&mut c, &["a"])).is_some());
        assert!(c.submit(0, vec![ar("a", 4)]).is_empty());
        assert!(c
            .submit(0, vec![Request::new(OpKind::OfflineAck, "o", 0)])
            .is_empty());
        let out = c.submit(1, vec![Request::new(OpKind::OfflineAck, "o", 0)]);
        assert_eq!(
            out.last().map(|o| &o.1),
            Some(&Response::Switch {
                go: false,
                skip: vec![]
            })
        );
    }

    #[test]
    fn different_steps_or_other_ops_are_not_offered() {
        let mut c = Coordinator::new(2, 1 << 20).with_offline(true);
        step(&mut c, &["a", "b"]);
        step(&mut c, &["a", "b"]);
        let mut barrier = vec![];
        barrier.extend(c.submit(0, vec![Request::new(OpKind::Barrier, "x", 0)]));
        barrier.extend(c.submit(1, vec![Request::new(OpKind::Barrier, "x", 0)]));
        assert!(
            offer_of(&step(&mut c, &["a", "b"])).is_none(),
            "barrier resets"
        );
        assert!(offer_of(&step(&mut c, &["a", "c"])).is_none());
        assert!(offer_of(&step(&mut c, &["a", "b"])).is_none());
        let mut off = Coordinator::new(2, 1 << 20);
        for _ in 0..5 {
            assert!(
                offer_of(&step(&mut off, &["a"])).is_none(),
                "off by default"
            );
        }
    }

    #[test]
    fn schedule_matches_signatures_and_skips_only_the_first_pass() {
        let mut c = Coordinator::new(2, 1 << 20).with_offline(true);
        step(&mut c, &["a", "b", "c"]);
        step(&mut c, &["a", "b", "c"]);
        let groups = offer_of(&step(&mut c, &["a", "b", "c"])).unwrap();
        let mut s = Schedule::new(groups, vec!["a".into(), "b".into()]);
        assert!(s.fits(&ar("a", 4)));
        assert!(!s.fits(&ar("a", 5)), "shape changed");
        assert!(!s.fits(&ar("z", 4)), "unknown name");
        let mut other = ar("a", 4);
        other.process_set = 1;
        assert!(!s.fits(&other));
        let order: Vec<Vec<String>> = (0..4)
            .map(|_| {
                let g = s.next();
                s.advance();
                match g {
                    Response::Op { names, .. } => names,
                    _ => unreachable!(),
                }
            })
            .collect();
        assert_eq!(order, vec![vec!["c"], vec!["a"], vec!["b"], vec!["c"]]);
    }

    #[test]
    fn groups_ready_ahead_are_counted_in_order_within_one_pass() {
        let mut c = Coordinator::new(2, 1 << 20).with_offline(true);
        step(&mut c, &["a", "b", "c"]);
        step(&mut c, &["a", "b", "c"]);
        let groups = offer_of(&step(&mut c, &["a", "b", "c"])).unwrap();
        let held = |names: &[&str]| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            move |g: &Response| match g {
                Response::Op { names: ns, .. } => ns.iter().all(|n| names.contains(n)),
                _ => false,
            }
        };
        // First pass without "a": "b", "c", then the next pass's "a" and so on.
        let s = Schedule::new(groups.clone(), vec!["a".into()]);
        assert_eq!(s.ready_ahead(held(&["b", "c"])), 2);
        assert_eq!(s.ready_ahead(held(&["c"])), 0, "the first group is missing");
        assert_eq!(
            s.ready_ahead(held(&["a", "b", "c"])),
            3,
            "as many as the schedule has"
        );
        let s = Schedule::new(groups, vec![]);
        assert_eq!(
            s.ready_ahead(held(&["a", "c"])),
            1,
            "stops at the first missing"
        );
    }
}
