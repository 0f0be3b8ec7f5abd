//! Every node transition, in one place, beside the jobs' (`lifecycle.rs`):
//! a node and what happened (an agent registers, a heartbeat arrives or
//! stops arriving, an admin acts) in; the node's new state and the event
//! that records it out. Pure: no store, no lock, no clock (callers pass
//! `at`). The agent protocol, the admins' handlers and the cycle's timers
//! call these functions and commit what they change; none of them sets a
//! node's state itself.
//!
//! ```text
//!   joined ─► ready ◄──uncordon──► cordoned | draining     (the admin's state)
//!               │ ▲
//!    no beats   │ │ a heartbeat, or the agent registers again:
//!    for the    ▼ │ back to the admin's state
//!    timeout   lost ◄── replace (its token cleared; the next agent to
//!                        register the name with the join token takes it)
//! ```
//! A lost node's work is requeued by the cycle (`cycle.rs`, `timers`).

use gpuflow_api::{Inventory, NodeState};

use crate::event::EventKind;
use crate::state::NodeRec;

/// The event a transition records: its kind and its message.
pub type Event = (EventKind, String);

/// A node the server has not seen, joining: ready.
pub fn joined(name: &str, inventory: Inventory, token_hash: String, at: u64) -> (NodeRec, Event) {
    let said = format!(
        "node {name} joined with {} GPUs{}",
        inventory.gpus.len(),
        if inventory.emulated {
            " (emulated)"
        } else {
            ""
        }
    );
    let node = NodeRec {
        name: name.to_string(),
        state: NodeState::Ready,
        admin_state: NodeState::Ready,
        address: inventory.address.clone(),
        inventory,
        token_hash,
        last_heartbeat: at,
        health_cleared_at: 0,
        gpus_now: Vec::new(),
    };
    (node, (EventKind::NodeRegistered, said))
}

/// A known node whose agent registered again (restarted, or proved its
/// old token): back to the admin's state, with its new inventory and token.
pub fn registered_again(
    n: &mut NodeRec,
    inventory: Inventory,
    token_hash: String,
    at: u64,
) -> Event {
    n.state = n.admin_state;
    n.inventory = inventory;
    n.token_hash = token_hash;
    n.last_heartbeat = at;
    (
        EventKind::NodeRegistered,
        format!("node {} registered again", n.name),
    )
}

/// A heartbeat from a node: a lost one is back in the admin's state.
pub fn heard(n: &mut NodeRec) -> Option<Event> {
    if n.state != NodeState::Lost {
        return None;
    }
    n.state = n.admin_state;
    Some((EventKind::NodeBack, format!("node {} is back", n.name)))
}

/// Whether a node has missed heartbeats for longer than `timeout_s`.
pub fn overdue(n: &NodeRec, timeout_s: u64, at: u64) -> bool {
    n.state != NodeState::Lost && n.last_heartbeat + timeout_s < at
}

/// A node that missed its heartbeats: lost.
pub fn lost(n: &mut NodeRec, at: u64) -> Event {
    n.state = NodeState::Lost;
    (
        EventKind::NodeLost,
        format!(
            "node {} lost: no heartbeat for {} s",
            n.name,
            at.saturating_sub(n.last_heartbeat)
        ),
    )
}

/// An admin's `node replace`: the machine behind the name is gone, its
/// token stops working and it is lost.
pub fn released(n: &mut NodeRec, by: &str) -> Event {
    n.token_hash.clear();
    n.state = NodeState::Lost;
    (
        EventKind::NodeReplace,
        format!(
            "node {} released for replacement by {by}; its work is requeued",
            n.name
        ),
    )
}

/// An admin's drain, cordon or uncordon (`to`: `Draining`, `Cordoned` or
/// `Ready`): the admin's state, and the node's unless it is lost (it comes
/// back in the admin's state).
pub fn set_by_admin(n: &mut NodeRec, to: NodeState, by: &str) -> Event {
    n.admin_state = to;
    if n.state != NodeState::Lost {
        n.state = to;
    }
    let name = &n.name;
    match to {
        NodeState::Draining => (
            EventKind::NodeDrain,
            format!(
                "node {name} draining (by {by}): running jobs finish, service replicas move to other nodes, nothing new starts"
            ),
        ),
        NodeState::Cordoned => (
            EventKind::NodeCordon,
            format!("node {name} cordoned by {by}"),
        ),
        _ => (
            EventKind::NodeUncordon,
            format!("node {name} uncordoned by {by}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory() -> Inventory {
        serde_json::from_str(
            r#"{"cpu_milli": 1000, "memory_mib": 1024, "gpus": [], "emulated": true}"#,
        )
        .unwrap()
    }

    fn node() -> NodeRec {
        let (n, (kind, said)) = joined("n1", inventory(), "h".into(), 100);
        assert_eq!(
            (kind, said.as_str()),
            (
                EventKind::NodeRegistered,
                "node n1 joined with 0 GPUs (emulated)"
            )
        );
        n
    }

    #[test]
    fn a_lost_node_comes_back_in_the_admins_state() {
        let mut n = node();
        assert_eq!(n.state, NodeState::Ready);
        assert!(heard(&mut n).is_none(), "a ready node is not back");
        set_by_admin(&mut n, NodeState::Cordoned, "ada");
        assert!(!overdue(&n, 30, 130));
        assert!(overdue(&n, 30, 131));
        let (kind, said) = lost(&mut n, 131);
        assert_eq!(
            (kind, said.as_str()),
            (EventKind::NodeLost, "node n1 lost: no heartbeat for 31 s")
        );
        assert!(!overdue(&n, 30, 1000), "lost once");
        // Uncordoned while lost: it stays lost until it is heard.
        set_by_admin(&mut n, NodeState::Ready, "ada");
        assert_eq!(
            (n.state, n.admin_state),
            (NodeState::Lost, NodeState::Ready)
        );
        assert_eq!(heard(&mut n).map(|e| e.0), Some(EventKind::NodeBack));
        assert_eq!(n.state, NodeState::Ready);
    }

    #[test]
    fn a_released_node_is_lost_until_an_agent_registers_again() {
        let mut n = node();
        set_by_admin(&mut n, NodeState::Draining, "ada");
        released(&mut n, "ada");
        assert_eq!(n.state, NodeState::Lost);
        assert!(n.token_hash.is_empty());
        registered_again(&mut n, inventory(), "h2".into(), 200);
        assert_eq!(
            (n.state, n.token_hash.as_str(), n.last_heartbeat),
            (NodeState::Draining, "h2", 200)
        );
    }
}
