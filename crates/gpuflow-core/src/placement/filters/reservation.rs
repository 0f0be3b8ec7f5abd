//! `reservation`: nodes held for a blocked gang's reservation take only work
//! that ends before the reservation starts (backfill).

use super::NodeView;
use crate::placement::Reject;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    if v.reserved && v.cons.avoid_reserved {
        Err(Reject::Reserved)
    } else {
        Ok(())
    }
}
