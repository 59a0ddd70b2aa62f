//! What a relay of the control tree ([`crate::transport::tree`]) holds back: a request
//! for a name the response cache knows waits at the relay until every rank below it
//! that takes part in that name has asked, then goes up once for all of them. Rank 0
//! cannot answer a name before its last rank asks, so the wait costs no time, and rank
//! 0 hears of a name once from each child however the ranks' requests straggle in: its
//! frames a step follow its children, not the ranks.
//!
//! A relay learns who takes part in a name from the answers it passes down: the
//! response-cache entry of a name goes to exactly the members of its process set.
//! Ranks that joined (`hvd.join`) or shut down count as having asked. A name that some
//! rank has still not asked for after [`LATE_HOLD`] goes up as far as it got, so that
//! rank 0's stall check can name the ranks that never asked; the rest of the round goes
//! up as soon as it is whole.
//!
//! Everything else (names not in the cache yet, kinds that are never cached) is not
//! held here: the relay passes it on as it came ([`Gather::offer`]'s rest).

use super::message::{encode_requests, OpKind, Response, WireRequest};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long a relay holds a cached name for ranks below it that have not asked for it
/// yet, before it passes up those that have.
pub const LATE_HOLD: Duration = Duration::from_secs(1);

/// A name within its process set.
type Key = (u32, String);

/// A batch of requests to pass up: the ranks that sent it (ascending), and the
/// requests encoded as they sent them.
pub type Gathered = (Vec<usize>, Vec<u8>);

/// The requests for one name since its last answer.
#[derive(Default)]
struct Round {
    /// The ranks that asked (passed up or not).
    asked: BTreeSet<usize>,
    /// Requests not passed up yet, each with the ranks that sent it.
    unsent: Vec<(Vec<usize>, WireRequest)>,
    /// When the oldest unsent request came.
    since: Option<Instant>,
}

/// A relay's requests for cached names, held until each name's round is whole.
#[derive(Default)]
pub struct Gather {
    /// Cache id to the name it stands for.
    ids: HashMap<u32, Key>,
    /// Each cached name: the ranks here (this relay and those below it) that ask
    /// for it, ascending.
    takers: HashMap<Key, Vec<usize>>,
    /// Ranks below that joined, by process set, until the join is answered.
    joined: HashMap<u32, HashSet<usize>>,
    /// Ranks below that shut down.
    shut: HashSet<usize>,
    rounds: HashMap<Key, Round>,
    /// Whole rounds' requests, to go up next.
    ready: Vec<(Vec<usize>, WireRequest)>,
}

/// What [`Gather::offer`] did not keep.
#[derive(Debug, Default, PartialEq)]
pub struct Rest {
    /// Requests to pass on as they came.
    pub requests: Vec<WireRequest>,
    /// A join or shutdown among them: what is held goes up first, now.
    pub urgent: bool,
}

impl Gather {
    /// Learns from a response passed down to `ranks` (this relay's and those below it).
    pub fn learn(&mut self, resp: &Response, ranks: &[usize]) {
        match resp {
            Response::Cached {
                process_set,
                name,
                id,
            } => {
                let mut takers = ranks.to_vec();
                takers.sort_unstable();
                takers.dedup();
                let key = (*process_set, name.clone());
                self.ids.insert(*id, key.clone());
                self.takers.insert(key, takers);
            }
            Response::Done {
                kind: OpKind::Join,
                process_set,
                ..
            } => {
                self.joined.remove(process_set);
                // Rounds that counted the joined ranks as asked now wait for them.
            }
            _ => {}
        }
    }

    /// Takes the requests that `origins` sent alike: those of cached names stay
    /// until their rounds are whole; the rest come back.
    pub fn offer(&mut self, origins: &[usize], reqs: Vec<WireRequest>, now: Instant) -> Rest {
        let mut rest = Rest::default();
        let mut touched: Vec<Key> = Vec::new();
        for req in reqs {
            let key = match &req {
                WireRequest::Full(r) => {
                    match r.kind {
                        OpKind::Join => {
                            let j = self.joined.entry(r.process_set).or_default();
                            j.extend(origins.iter().copied());
                            rest.urgent = true;
                        }
                        OpKind::Shutdown => {
                            self.shut.extend(origins.iter().copied());
                            rest.urgent = true;
                        }
                        _ => {}
                    }
                    Some((r.process_set, r.name.clone()))
                }
                WireRequest::Cached(id) => self.ids.get(id).cloned(),
            };
            let Some(key) = key.filter(|k| self.takers.contains_key(k)) else {
                rest.requests.push(req);
                continue;
            };
            let round = self.rounds.entry(key.clone()).or_default();
            if origins.iter().any(|o| round.asked.contains(o)) {
                // A rank asks again: the name was answered without waiting for this
                // round to be whole (a rank below left it), so a new round begins.
                self.ready.append(&mut round.unsent);
                *round = Round::default();
            }
            round.asked.extend(origins.iter().copied());
            round.unsent.push((origins.to_vec(), req));
            round.since.get_or_insert(now);
            touched.push(key);
        }
        if rest.urgent {
            // A join or shutdown excuses ranks from every round.
            touched = self.rounds.keys().cloned().collect();
        }
        for key in touched {
            self.close_if_whole(&key);
        }
        rest
    }

    /// Moves `key`'s round to [`Gather::ready`] once every taker asked or is excused.
    fn close_if_whole(&mut self, key: &Key) {
        let (Some(takers), Some(round)) = (self.takers.get(key), self.rounds.get(key)) else {
            return;
        };
        let joined = self.joined.get(&key.0);
        let excused = |r: &usize| self.shut.contains(r) || joined.is_some_and(|j| j.contains(r));
        if takers.iter().all(|r| round.asked.contains(r) || excused(r)) {
            let round = self.rounds.remove(key).expect("looked up above");
            self.ready.extend(round.unsent);
        }
    }

    /// The requests to pass up now: whole rounds', those that waited [`LATE_HOLD`],
    /// or (`all`) everything held. Each distinct set of ranks gets one batch.
    pub fn take(&mut self, now: Instant, all: bool) -> Vec<Gathered> {
        let mut out = std::mem::take(&mut self.ready);
        for round in self.rounds.values_mut() {
            let late = round.since.is_some_and(|t| now >= t + LATE_HOLD);
            if all || late {
                out.append(&mut round.unsent);
                round.since = None;
            }
        }
        batches(out)
    }

    /// How long until held requests are late (None: none held).
    pub fn due(&self, now: Instant) -> Option<Duration> {
        self.rounds
            .values()
            .filter_map(|r| r.since)
            .min()
            .map(|t| (t + LATE_HOLD).saturating_duration_since(now))
    }

    /// Whether requests are held.
    #[cfg(test)]
    fn holds(&self) -> bool {
        !self.ready.is_empty() || self.rounds.values().any(|r| !r.unsent.is_empty())
    }
}

/// Groups requests by the ranks that sent them: a request sent alike by several
/// batches once with all their ranks, then one batch for each distinct set of ranks.
fn batches(items: Vec<(Vec<usize>, WireRequest)>) -> Vec<Gathered> {
    let mut by_req: Vec<(Vec<usize>, WireRequest)> = Vec::new();
    let mut at: HashMap<Vec<u8>, usize> = HashMap::new();
    for (origins, req) in items {
        let bytes = encode_requests(std::slice::from_ref(&req));
        match at.get(&bytes) {
            Some(&i) => by_req[i].0.extend(origins),
            None => {
                at.insert(bytes, by_req.len());
                by_req.push((origins, req));
            }
        }
    }
    let mut out: Vec<(Vec<usize>, Vec<WireRequest>)> = Vec::new();
    let mut by_ranks: HashMap<Vec<usize>, usize> = HashMap::new();
    for (mut origins, req) in by_req {
        origins.sort_unstable();
        origins.dedup();
        match by_ranks.get(&origins) {
            Some(&i) => out[i].1.push(req),
            None => {
                by_ranks.insert(origins.clone(), out.len());
                out.push((origins, vec![req]));
            }
        }
    }
    out.into_iter()
        .map(|(origins, reqs)| (origins, encode_requests(&reqs)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::message::{decode_requests, Request};

    fn cached(id: u32, name: &str, ranks: &[usize]) -> (Response, Vec<usize>) {
        let resp = Response::Cached {
            process_set: 0,
            name: name.into(),
            id,
        };
        (resp, ranks.to_vec())
    }

    /// A relay (rank 8) over ranks 9..=12 that learned ids 1 ("a") and 2 ("b").
    fn relay() -> Gather {
        let mut g = Gather::default();
        for (id, name) in [(1, "a"), (2, "b")] {
            let (resp, ranks) = cached(id, name, &[8, 9, 10, 11, 12]);
            g.learn(&resp, &ranks);
        }
        g
    }

    fn decoded(items: Vec<Gathered>) -> Vec<(Vec<usize>, Vec<WireRequest>)> {
        items
            .into_iter()
            .map(|(o, p)| (o, decode_requests(&p).unwrap()))
            .collect()
    }

    #[test]
    fn a_cached_name_goes_up_once_every_taker_asked() {
        let mut g = relay();
        let t = Instant::now();
        let a = WireRequest::Cached(1);
        assert_eq!(g.offer(&[9, 10], vec![a.clone()], t), Rest::default());
        assert_eq!(g.offer(&[8], vec![a.clone()], t), Rest::default());
        assert!(
            g.take(t, false).is_empty(),
            "ranks 11 and 12 have not asked"
        );
        assert_eq!(g.due(t), Some(LATE_HOLD));
        g.offer(&[11, 12], vec![a.clone(), WireRequest::Cached(2)], t);
        assert_eq!(
            decoded(g.take(t, false)),
            vec![(vec![8, 9, 10, 11, 12], vec![a])],
            "one batch for all five ranks; 'b' waits"
        );
        assert!(g.holds());
    }

    #[test]
    fn a_name_sent_in_full_counts_for_its_round() {
        // A rank whose tensor changed shape sends the name in full, not its id.
        let mut g = relay();
        let t = Instant::now();
        let mut full = Request::new(OpKind::Allreduce, "a", 0);
        full.shape = vec![3];
        g.offer(&[8, 9, 10, 11], vec![WireRequest::Cached(1)], t);
        g.offer(&[12], vec![WireRequest::Full(full.clone())], t);
        assert_eq!(
            decoded(g.take(t, false)),
            vec![
                (vec![8, 9, 10, 11], vec![WireRequest::Cached(1)]),
                (vec![12], vec![WireRequest::Full(full)]),
            ]
        );
    }

    #[test]
    fn names_unknown_to_the_cache_pass_on() {
        let mut g = relay();
        let t = Instant::now();
        let c = Request::new(OpKind::Allreduce, "c", 0);
        let got = g.offer(
            &[9],
            vec![WireRequest::Full(c.clone()), WireRequest::Cached(7)],
            t,
        );
        assert_eq!(
            got.requests,
            vec![WireRequest::Full(c), WireRequest::Cached(7)]
        );
        assert!(!got.urgent && !g.holds());
    }

    #[test]
    fn a_late_rank_lets_the_others_go_after_the_hold_and_closes_the_round() {
        let mut g = relay();
        let t = Instant::now();
        g.offer(&[8, 9, 10, 11], vec![WireRequest::Cached(1)], t);
        assert!(g.take(t + LATE_HOLD / 2, false).is_empty());
        let late = decoded(g.take(t + LATE_HOLD, false));
        assert_eq!(
            late,
            vec![(vec![8, 9, 10, 11], vec![WireRequest::Cached(1)])]
        );
        assert_eq!(g.due(t + LATE_HOLD), None, "nothing unsent");
        // Rank 12 comes at last: its request goes up at once.
        g.offer(&[12], vec![WireRequest::Cached(1)], t + LATE_HOLD * 2);
        let now = decoded(g.take(t + LATE_HOLD * 2, false));
        assert_eq!(now, vec![(vec![12], vec![WireRequest::Cached(1)])]);
        assert!(!g.holds());
    }

    #[test]
    fn joined_and_shut_ranks_are_not_waited_for_until_the_join_is_answered() {
        let mut g = relay();
        let t = Instant::now();
        g.offer(&[8, 9, 10], vec![WireRequest::Cached(1)], t);
        // Rank 12 joins: what is held goes up before its join.
        let join = Request::new(OpKind::Join, "join", 0);
        let got = g.offer(&[12], vec![WireRequest::Full(join.clone())], t);
        assert_eq!(got.requests, vec![WireRequest::Full(join)]);
        assert!(got.urgent);
        assert_eq!(
            decoded(g.take(t, true)),
            vec![(vec![8, 9, 10], vec![WireRequest::Cached(1)])]
        );
        // Rank 11 shuts down; from now on rounds need ranks 8, 9 and 10 only.
        let bye = Request::new(OpKind::Shutdown, "shutdown", 0);
        assert!(g.offer(&[11], vec![WireRequest::Full(bye)], t).urgent);
        g.offer(&[8, 9, 10], vec![WireRequest::Cached(2)], t);
        assert_eq!(
            decoded(g.take(t, false)),
            vec![(vec![8, 9, 10], vec![WireRequest::Cached(2)])]
        );
        // The join is answered: rank 12 is waited for again, rank 11 is not.
        let done = Response::Done {
            kind: OpKind::Join,
            process_set: 0,
            name: "join".into(),
            value: 12,
        };
        g.learn(&done, &[8, 9, 10, 11, 12]);
        g.offer(&[8, 9, 10], vec![WireRequest::Cached(2)], t);
        assert!(g.take(t, false).is_empty());
        g.offer(&[12], vec![WireRequest::Cached(2)], t);
        assert_eq!(
            decoded(g.take(t, false)),
            vec![(vec![8, 9, 10, 12], vec![WireRequest::Cached(2)])]
        );
    }

    #[test]
    fn a_rank_asking_again_starts_a_new_round() {
        // Rank 12 never asked, yet the name was answered: its round ends when a rank
        // asks again.
        let mut g = relay();
        let t = Instant::now();
        g.offer(&[8, 9, 10, 11], vec![WireRequest::Cached(1)], t);
        g.offer(&[9], vec![WireRequest::Cached(1)], t);
        assert_eq!(
            decoded(g.take(t, false)),
            vec![(vec![8, 9, 10, 11], vec![WireRequest::Cached(1)])]
        );
        assert!(g.holds(), "rank 9's second request waits for the new round");
    }

    #[test]
    fn a_process_set_waits_only_for_its_members_below() {
        let mut g = Gather::default();
        let resp = Response::Cached {
            process_set: 3,
            name: "s".into(),
            id: 5,
        };
        g.learn(&resp, &[10, 9]);
        let t = Instant::now();
        g.offer(&[9], vec![WireRequest::Cached(5)], t);
        assert!(g.take(t, false).is_empty());
        g.offer(&[10], vec![WireRequest::Cached(5)], t);
        assert_eq!(
            decoded(g.take(t, false)),
            vec![(vec![9, 10], vec![WireRequest::Cached(5)])]
        );
    }
}
