use std::collections::VecDeque;
use std::time::Duration;

use super::{Epoch, MembershipConfig, NodeId, View};

/// What a node's membership machine asks its actor to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberAction {
    SendHeartbeat {
        epoch: Epoch,
    },
    /// Ask the controller to join, naming this membership's incarnation (see [`MemberState::incarnation`]).
    SendJoinRequest {
        incarnation: u64,
    },
    /// A newer view arrived: re-rank, abort work of older epochs.
    AdoptView(View),
    /// This node was removed (fenced or absent from a new view): drop all job state and rejoin.
    Fenced {
        current: Epoch,
    },
    /// Nothing heard from the controller for the failure timeout.
    ControllerLost {
        silent_ms: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Joining,
    Member,
}

/// A node's side of membership: heartbeats, view adoption, fencing, controller-loss detection.
#[derive(Debug)]
pub struct MemberState {
    id: NodeId,
    config: MembershipConfig,
    incarnation: u64,
    status: Status,
    view: Option<View>,
    last_heard: Duration,
    next_send: Duration,
    controller_lost: bool,
    actions: VecDeque<MemberAction>,
}

impl MemberState {
    /// A node that starts by asking to join at `now`. `incarnation` must differ from any an earlier
    /// process of this node used (a random number, say): the controller takes a join carrying the
    /// incarnation it admitted for a duplicate, and any other for a restart.
    pub fn joining(id: NodeId, config: MembershipConfig, now: Duration, incarnation: u64) -> Self {
        Self {
            id,
            config,
            incarnation,
            status: Status::Joining,
            view: None,
            last_heard: now,
            next_send: now,
            controller_lost: false,
            actions: VecDeque::new(),
        }
    }

    /// A node that is a member of `view` from the start.
    pub fn member(id: NodeId, config: MembershipConfig, now: Duration, view: View, incarnation: u64) -> Self {
        let mut state = Self::joining(id, config, now, incarnation);
        state.status = Status::Member;
        state.view = Some(view);
        state
    }

    pub fn view(&self) -> Option<&View> {
        self.view.as_ref().filter(|_| self.status == Status::Member)
    }

    pub fn epoch(&self) -> Option<Epoch> {
        self.view().map(|v| v.epoch)
    }

    /// Names this membership of the node: the process's starting value, plus one per fence (a fenced node
    /// aborted its attempts, so it rejoins as a new member, not as the one the controller removed).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The controller sent a view.
    pub fn handle_view(&mut self, now: Duration, view: View) {
        self.heard_from_controller(now);
        if self.view.as_ref().is_some_and(|v| v.epoch >= view.epoch) {
            return; // stale or duplicate
        }
        if view.contains(&self.id) {
            self.status = Status::Member;
            self.view = Some(view.clone());
            self.actions.push_back(MemberAction::AdoptView(view));
        } else if self.status == Status::Member {
            self.fence(view.epoch);
        }
    }

    /// The controller refused a message of ours: we are not a member of its view.
    pub fn handle_fence(&mut self, now: Duration, current: Epoch) {
        self.heard_from_controller(now);
        if self.status == Status::Member {
            self.fence(current);
        }
    }

    /// Any other message from the controller (it is alive).
    pub fn heard_from_controller(&mut self, now: Duration) {
        self.last_heard = self.last_heard.max(now);
        self.controller_lost = false;
    }

    pub fn handle_timeout(&mut self, now: Duration) {
        if now >= self.next_send {
            self.actions.push_back(match (self.status, &self.view) {
                (Status::Member, Some(view)) => MemberAction::SendHeartbeat { epoch: view.epoch },
                _ => MemberAction::SendJoinRequest { incarnation: self.incarnation },
            });
            self.next_send = now + self.config.heartbeat_interval();
        }
        let silence = now.saturating_sub(self.last_heard);
        if !self.controller_lost && silence >= self.config.failure_timeout() {
            self.controller_lost = true;
            self.actions.push_back(MemberAction::ControllerLost { silent_ms: silence.as_millis() as u64 });
        }
    }

    pub fn poll_timeout(&self) -> Duration {
        if self.controller_lost {
            self.next_send
        } else {
            self.next_send.min(self.last_heard + self.config.failure_timeout())
        }
    }

    pub fn poll_action(&mut self) -> Option<MemberAction> {
        self.actions.pop_front()
    }

    fn fence(&mut self, current: Epoch) {
        self.status = Status::Joining;
        self.view = None;
        self.incarnation = self.incarnation.wrapping_add(1);
        self.actions.push_back(MemberAction::Fenced { current });
        self.actions.push_back(MemberAction::SendJoinRequest { incarnation: self.incarnation });
    }
}
