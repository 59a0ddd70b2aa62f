//! The shape of the control plane: which rank each rank sends its requests to (its
//! parent) and which ranks' requests it relays (its children). A job of at most
//! [`STAR_MAX`] ranks is a star around rank 0. A larger one is a tree that follows the
//! hosts: the first rank of each host (its leader) hangs in a tree of the leaders of
//! fan-out [`FAN_OUT`] under rank 0, and the other ranks of a host in a tree of the same
//! fan-out under their leader. Rank 0 then hears from at most 2·[`FAN_OUT`] ranks, a
//! rank holds at most 2·[`FAN_OUT`] + 1 control streams, only leaders' streams cross
//! hosts, and a request climbs log(hosts) + log(ranks a host) hops.
//!
//! Every rank computes the same tree from the table of hosts it read at init.

use std::collections::BTreeMap;

/// Jobs of up to this many ranks negotiate in a star around rank 0.
pub const STAR_MAX: usize = 16;

/// Children a rank has in each of its trees (that of the leaders, that of its host).
pub const FAN_OUT: usize = 8;

/// One rank's place in the control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The rank it sends to (None for rank 0).
    pub parent: Option<usize>,
    /// The ranks that send to it, each with the ranks of its subtree (itself first).
    pub children: Vec<(usize, Vec<usize>)>,
}

/// The parent of every rank (None for rank 0), from each rank's host key.
pub fn parents(hosts: &[String]) -> Vec<Option<usize>> {
    let n = hosts.len();
    let mut parent = vec![None; n];
    if n <= STAR_MAX {
        for p in parent.iter_mut().skip(1) {
            *p = Some(0);
        }
        return parent;
    }
    // Hosts in the order of their first rank; rank 0's host comes first.
    let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        let g = groups.entry(h.as_str()).or_default();
        if g.is_empty() {
            order.push(h.as_str());
        }
        g.push(r);
    }
    let leaders: Vec<usize> = order.iter().map(|h| groups[h][0]).collect();
    let up = |i: usize| (i - 1) / FAN_OUT;
    for (i, &l) in leaders.iter().enumerate().skip(1) {
        parent[l] = Some(leaders[up(i)]);
    }
    for h in &order {
        let g = &groups[h];
        for (j, &r) in g.iter().enumerate().skip(1) {
            parent[r] = Some(g[up(j)]);
        }
    }
    parent
}

/// Rank `me`'s place among `parents` (as [`parents`] gives them).
pub fn place(parents: &[Option<usize>], me: usize) -> Place {
    let n = parents.len();
    let mut kids: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (r, p) in parents.iter().enumerate() {
        if let Some(p) = p {
            kids[*p].push(r);
        }
    }
    let subtree = |top: usize| {
        let mut all = vec![top];
        let mut i = 0;
        while i < all.len() {
            all.extend(kids[all[i]].iter().copied());
            i += 1;
        }
        all
    };
    Place {
        parent: parents[me],
        children: kids[me].iter().map(|&c| (c, subtree(c))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: usize, per_host: usize) -> Vec<String> {
        (0..n).map(|r| format!("h{}", r / per_host)).collect()
    }

    #[test]
    fn a_small_job_is_a_star() {
        let p = parents(&hosts(STAR_MAX, 4));
        assert_eq!(p[0], None);
        assert!(p[1..].iter().all(|&q| q == Some(0)));
        let root = place(&p, 0);
        assert_eq!(root.children.len(), STAR_MAX - 1);
        assert!(root.children.iter().all(|(c, sub)| sub == &vec![*c]));
    }

    #[test]
    fn a_thousand_ranks_on_sixteen_hosts_follow_the_hosts_with_bounded_fan_out() {
        let (n, per) = (1024, 64);
        let h = hosts(n, per);
        let p = parents(&h);
        assert_eq!(p[0], None);
        // Every rank reaches rank 0, and only leaders have parents on other hosts.
        for r in 1..n {
            let (mut at, mut hops) = (r, 0);
            while let Some(up) = p[at] {
                if h[up] != h[at] {
                    assert_eq!(at % per, 0, "rank {at} is no leader but crosses hosts");
                }
                at = up;
                hops += 1;
                assert!(hops < 16);
            }
            assert_eq!(at, 0);
            assert!(hops <= 4, "rank {r}: {hops} hops");
        }
        // Children: at most FAN_OUT in each tree a rank is in (2 for leaders).
        let mut covered = vec![false; n];
        covered[0] = true;
        for r in 0..n {
            let pl = place(&p, r);
            assert!(pl.children.len() <= 2 * FAN_OUT, "rank {r}");
            if r % per != 0 {
                assert!(pl.children.len() <= FAN_OUT, "rank {r}");
            }
            for (c, sub) in &pl.children {
                assert_eq!(sub[0], *c);
                assert_eq!(p[*c], Some(r));
            }
        }
        // Rank 0's subtrees partition the other ranks.
        for (_, sub) in place(&p, 0).children {
            for r in sub {
                assert!(!covered[r], "rank {r} in two subtrees");
                covered[r] = true;
            }
        }
        assert!(covered.iter().all(|&c| c));
    }

    #[test]
    fn hosts_in_any_order_and_of_any_size_still_form_one_tree() {
        // Round-robin placement: every host's ranks are interleaved.
        let h: Vec<String> = (0..100).map(|r| format!("h{}", r % 7)).collect();
        let p = parents(&h);
        for r in 1..100 {
            let mut at = r;
            let mut hops = 0;
            while let Some(up) = p[at] {
                at = up;
                hops += 1;
                assert!(hops < 20);
            }
            assert_eq!(at, 0);
        }
    }
}
