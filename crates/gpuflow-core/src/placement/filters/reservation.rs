//! `reservation`: nodes held for a blocked gang's reservation take only work
//! that ends before the reservation starts (backfill): work keeps off the
//! reservation slots its constraints name.

use super::NodeView;
use crate::placement::Reject;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    if v.reserved != 0 && v.cons.avoid_reservations & (1u64 << v.reserved) != 0 {
        Err(Reject::Reserved)
    } else {
        Ok(())
    }
}
